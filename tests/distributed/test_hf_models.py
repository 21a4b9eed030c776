"""Hugging Face models built under `zeromem.Init` equal their plain builds and train at stage 3.

Tiny GPT-2, Llama, BERT and T5, built from small configs (nothing is downloaded).
Their `post_init()` re-initialises every parameter after the children are attached
and partitioned, and BERT writes through an indexed view (`init.zeros_(weight[0])`),
so these exercise `Init`'s whole-while-touched path. The ranks are seeded differently
under `Init`: rank 0's values must win, as DeepSpeed's `zero.Init` broadcasts them.
"""
from __future__ import annotations

import pytest
import torch

import zeromem
from harness import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 8, 2


def tiny_models() -> dict:
    """name -> builder of a tiny model with dropout off (losses comparable step by step)."""
    t = transformers
    small = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=2)
    return {
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(
            n_embd=16, n_layer=2, n_head=2, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_key_value_heads=1,
            max_position_embeddings=SEQ, **small)),
        "bert": lambda: t.BertForMaskedLM(t.BertConfig(
            hidden_size=16, intermediate_size=32, max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small)),
        "t5": lambda: t.T5ForConditionalGeneration(t.T5Config(
            d_model=16, d_ff=32, d_kv=8, num_layers=2, num_heads=2, vocab_size=VOCAB,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
    }


def batch(name: str, step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(10 * step + rank)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    if name == "t5":
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids if name != "bert" else labels}


def stage3_config() -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0,
            # no weight decay: T5 has parameters no loss reaches; torch skips them (grad None),
            # the engine sees zero gradients, and decay alone would move them
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def build(builder, seed: int, under_init: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    if not under_init:
        return builder()
    with zeromem.Init():
        return builder()


def max_diff(a: dict, b: dict) -> float:
    return max((float((a[k].float() - v.float()).abs().max()) for k, v in b.items()
                if v.numel()), default=0.0)


def build_and_train(rank, world_size):
    out = {}
    for name, builder in tiny_models().items():
        plain = build(builder, 0, under_init=False)
        # rank 1 draws other values; Init must end with rank 0's (the plain build's)
        engine = zeromem.initialize(build(builder, rank, under_init=True), stage3_config())
        full = engine.full_state_dict()  # rank 0 only: the whole model, gathered
        built = max_diff(full, plain.state_dict()) if full else 0.0
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
        losses = []
        for step in range(2):
            loss = engine(**batch(name, step, rank)).loss
            engine.backward(loss)
            engine.step()
            opt.zero_grad()
            ref = [plain(**batch(name, step, r)).loss for r in range(world_size)]
            (sum(ref) / world_size).backward()
            opt.step()
            losses.append(abs(loss.item() - ref[rank].item()))
        out[name] = (built, losses)
    return out


def test_hf_models_build_under_init_like_plain_and_train_at_stage3():
    for per_model in run_distributed(build_and_train, 2):
        assert set(per_model) == {"gpt2", "llama", "bert", "t5"}
        for name, (built, losses) in per_model.items():
            assert built == 0.0, (name, built)
            assert max(losses) < 1e-5, (name, losses)
