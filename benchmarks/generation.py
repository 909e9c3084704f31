"""The vLLM generator against transformers `generate` on the same model, prompts and sampling settings.

    python -m benchmarks.generation [--job deploy/jobs/demo.yaml] [--prompts 32] [--samples 8]
                                    [--max-new-tokens 64] [--rounds 3]

Both engines run in this process, so with the same torch threads (vLLM's CPU worker binds them at start
and then refuses `torch.set_num_threads`; the count used is printed), sample `--samples` responses per
prompt at temperature 1 (top_p 1, stopping at end-of-turn or `--max-new-tokens`), and are timed in
interleaved rounds; the ratio uses each engine's fastest round. Throughput counts generated tokens
only (up to and including end-of-turn, no padding), so the two can differ in how many they made.
"""

from __future__ import annotations

import argparse
import time
from itertools import islice

import torch


def _problems(job, count: int) -> tuple[str, list[list[dict[str, str]]]]:
    from cluster.job import job_task, load_job
    from cluster.run.model_prep import prepare_model

    loaded = load_job(job)
    task = job_task(loaded)
    return prepare_model(loaded, task), [task.messages(p) for p in islice(task.problems("bench", 0), count)]


class VllmEngine:
    def __init__(self, model_path: str, samples: int, max_new_tokens: int) -> None:
        from actors.generator import Generator, GeneratorSpec

        self.generator = Generator(
            GeneratorSpec(
                model_path,
                samples_per_prompt=samples,
                max_new_tokens=max_new_tokens,
                max_model_len=max_new_tokens + 128,
                kv_cache_mb=256,
            )
        )

    def run(self, prompts: list[list[dict[str, str]]], seed: int) -> int:
        from actors.generator import GenerationRequest

        requests = [GenerationRequest(i, str(i), messages, seed + i) for i, messages in enumerate(prompts)]
        groups = self.generator.generate(requests)
        return sum(len(c["completion_ids"]) for g in groups for c in g.completions)


class TransformersEngine:
    def __init__(self, model_path: str, samples: int, max_new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from actors.generator import chat_prompt_ids

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.samples, self.max_new_tokens, self.prompt_ids = samples, max_new_tokens, chat_prompt_ids

    @torch.inference_mode()
    def run(self, prompts: list[list[dict[str, str]]], seed: int) -> int:
        torch.manual_seed(seed)
        ids = [self.prompt_ids(self.tokenizer, messages) for messages in prompts]
        width = max(map(len, ids))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])  # left padding for decoding
        attention = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=self.max_new_tokens,
            num_return_sequences=self.samples,
            pad_token_id=pad,
            eos_token_id=self.model.generation_config.eos_token_id,
        )
        new = out[:, width:]
        eos = self.model.generation_config.eos_token_id
        tokens = 0
        for row in new.tolist():
            tokens += row.index(eos) + 1 if eos in row else len(row)
        return tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="deploy/jobs/demo.yaml")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    model_path, prompts = _problems(args.job, args.prompts)
    engines = {
        "vllm": VllmEngine(model_path, args.samples, args.max_new_tokens),
        "transformers": TransformersEngine(model_path, args.samples, args.max_new_tokens),
    }
    for engine in engines.values():  # warm-up: first-call compilation and allocation
        engine.run(prompts[:2], seed=0)
    best: dict[str, tuple[float, int]] = {}
    rounds: list[str] = []
    for round_ in range(args.rounds):
        rates: dict[str, float] = {}
        for name, engine in engines.items():
            start = time.perf_counter()
            tokens = engine.run(prompts, seed=1000 * round_)
            seconds = time.perf_counter() - start
            rates[name] = tokens / seconds
            if name not in best or tokens / seconds > best[name][1] / best[name][0]:
                best[name] = (seconds, tokens)
        rounds.append(
            f"round {round_ + 1}: "
            + ", ".join(f"{name} {rate:.0f} tok/s" for name, rate in rates.items())
            + f", vllm x transformers {rates['vllm'] / rates['transformers']:.2f}"
        )
    print(
        f"model {model_path}\n{args.prompts} prompts x {args.samples} samples, max_new_tokens "
        f"{args.max_new_tokens}, {torch.get_num_threads()} torch thread(s) for both, "
        f"best of {args.rounds} interleaved rounds\n"
    )
    print("\n".join(rounds) + "\n")
    print(f"{'engine':<14}{'seconds':>9}{'tokens':>9}{'tokens/s':>11}{'x transformers':>16}")
    reference = best["transformers"][1] / best["transformers"][0]
    for name, (seconds, tokens) in best.items():
        rate = tokens / seconds
        print(f"{name:<14}{seconds:>9.3f}{tokens:>9d}{rate:>11.0f}{rate / reference:>16.2f}")


if __name__ == "__main__":
    main()
