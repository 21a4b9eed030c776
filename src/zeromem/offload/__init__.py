"""ZeRO-Offload / ZeRO-Infinity: where masters, optimizer states and parameter shards live,
chosen at construction (`placement`, `params`), and the NVMe files and their asynchronous
I/O (`nvme`, `nvme_optimizer` and the update it runs, `updates`).
"""
