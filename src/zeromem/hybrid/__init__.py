"""Beyond one node: the node mesh and its groups, hybrid sharding and ZeRO++ (hpZ, qwZ, qgZ)
built from them, and the int4/int8 block quantization qwZ and qgZ send.
"""
