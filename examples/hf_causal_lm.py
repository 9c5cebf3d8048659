"""A Hugging Face causal language model in your own loop: transformers' GPT-2 (or Llama) built
from its config alone — no download, no weights — trained with gradmesh.Loop on characters of the
Python standard library's source.

    gradmesh run --nproc 2 examples/hf_causal_lm.py --strategy fsdp --run-dir runs/hf-own
    python examples/hf_causal_lm.py --run-dir runs/hf-own-1          # one process, the same model

Needs the hf extra: pip install -e '.[hf]'. FSDP shards each transformer block as a unit
(gradmesh finds the model's block list); ddp and zero1 work the same way.
"""

import argparse

import torch
import torch.nn.functional as F

import gradmesh
from gradmesh.data.corpus import char_datasets, load_text


def build(kind: str, vocab_size: int, block_size: int, layers: int, width: int) -> torch.nn.Module:
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                            max_position_embeddings=block_size, tie_word_embeddings=False,
                                            use_cache=False, bos_token_id=None, eos_token_id=None))
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_layer=layers, n_head=4,
                                      n_embd=width, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      tie_word_embeddings=False, use_cache=False, bos_token_id=None,
                                      eos_token_id=None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/hf-own")
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--strategy", default="ddp", help="ddp, zero1 or fsdp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--max-chars", type=int, default=1_000_000)
    args = parser.parse_args()

    gm = gradmesh.Loop(strategy=args.strategy, run_dir=args.run_dir, seed=0, grad_clip=1.0)
    train, _, vocab = char_datasets(load_text("", args.max_chars), args.block_size, 0.1)
    model = build(args.model, len(vocab.chars), args.block_size, args.layers, args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    model, optimizer = gm.prepare(model, optimizer)
    for _step, (inputs, targets) in gm.batches(train, args.global_batch_size, args.steps):
        logits = model(input_ids=inputs).logits
        gm.backward(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        gm.step(optimizer)
    summary = gm.close()
    if gm.rank == 0:
        print(f"final loss {summary['final_loss']:.4f} after {summary['samples']} samples")


if __name__ == "__main__":
    main()
