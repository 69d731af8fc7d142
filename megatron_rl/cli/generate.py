"""`megatron-rl generate`: complete chat prompts (command line or a file) with the native engine."""
from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from megatron_rl.cli.serve import add_engine_arguments, build_engine
from megatron_rl.config import ConfigError
from megatron_rl.rollout.engine import GenerateRequest, RequestError, SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="user messages (each one chat turn)")
    parser.add_argument("--file", help="prompts file: one per line, or JSONL with a 'prompt' field ('-' = stdin)")
    parser.add_argument("--system", default=None, help="system message (default: the chat template's)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("-n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--jsonl", action="store_true", help="print one JSON object per completion")
    add_engine_arguments(parser)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        try:
            handle = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--file {args.file}: {exc.strerror}") from None
        with handle:
            for number, line in enumerate(handle, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ConfigError(f"{args.file}:{number}: invalid JSON: {exc.msg}") from None
                    if not isinstance(record.get("prompt"), str):
                        raise ConfigError(f"{args.file}:{number}: a JSON line needs a string field 'prompt'")
                    line = record["prompt"]
                prompts.append(line)
    if not prompts:
        raise ConfigError("no prompts: pass them as arguments or with --file")
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    try:
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, top_k=args.top_k, n=args.n, seed=args.seed, stop=args.stop)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    engine = build_engine(args)
    try:
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ConfigError(f"{args.model}: the model has no tokenizer; cannot apply a chat template")
        requests = []
        for i, prompt in enumerate(prompts):
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}]
            requests.append(GenerateRequest(f"prompt-{i}", tokenizer.encode_chat(messages), sampling))
        try:
            futures = engine.submit(requests)
        except RequestError as exc:  # a prompt the engine cannot take (longer than its context): the user's
            raise ConfigError(f"{args.file + ': ' if args.file else ''}{exc}; raise --max-seq-len or shorten the "
                              "prompt") from None
        progress = None
        if len(futures) > 4 and sys.stderr.isatty() or len(futures) > 16:
            progress = tqdm(total=len(futures), desc="generate", unit="completion", file=sys.stderr)
            for f in futures:
                f.add_done_callback(lambda _: progress.update(1))
        completions = [f.result() for f in futures]
        if progress is not None:
            progress.close()
        per_prompt = args.n
        for index, c in enumerate(completions):
            prompt = prompts[index // per_prompt]
            text = tokenizer.decode(c.output_ids)
            if args.jsonl:
                print(json.dumps({"id": c.request_id, "prompt": prompt, "completion": text,
                                  "finish_reason": c.finish_reason, "tokens": len(c.output_ids),
                                  "logprob": sum(c.output_logprobs)}), flush=True)
            else:
                print(f"### {c.request_id} ({c.finish_reason}, {len(c.output_ids)} tokens)\n> {prompt}\n{text}\n",
                      flush=True)
    finally:
        engine.close()
    return 0
