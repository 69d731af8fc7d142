"""`megatron-rl chat MODEL [--feedback-agent FEEDBACK_MODEL] [MESSAGE ...]`: talk to a conversation
agent, optionally with a WaltzRL feedback agent in the loop (it is engaged only when it flags the answer
as unsafe or over-refusing; then the answer is revised with its feedback). Without messages, reads one
message per line from stdin."""
from __future__ import annotations

import argparse
import json
import sys

from megatron_rl.config import ConfigError
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.recipes.waltz.config import WaltzConfig
from megatron_rl.recipes.waltz.episodes import chat_with_feedback
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.native import NativeEngine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="conversation agent: GGUF, HF / Megatron checkpoint directory, or an alias "
                                      "(after training: RUN_DIR/checkpoints/step_N/model)")
    parser.add_argument("messages", nargs="*", help="user messages (each answered on its own; default: stdin lines)")
    parser.add_argument("--feedback-agent", default=None,
                        help="feedback agent model (after training: RUN_DIR/feedback/checkpoints/step_N/model)")
    parser.add_argument("--system", default=None, help="system message of the conversation agent")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--feedback-max-new-tokens", type=int, default=64)
    parser.add_argument("--max-revisions", type=int, default=1, help="T_max revision rounds")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--jsonl", action="store_true", help="print the whole episode as one JSON object per message")


def run(args: argparse.Namespace) -> int:
    try:
        config = WaltzConfig(max_revisions=args.max_revisions, feedback_max_new_tokens=args.feedback_max_new_tokens)
        engine_config = NativeEngineConfig(max_batch_size=4, max_seq_len=args.max_seq_len, num_threads=args.threads)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    model = load_pretrained(args.model)
    if model.tokenizer is None:
        raise ConfigError(f"{args.model}: the model has no tokenizer; cannot apply a chat template")
    conversation = NativeEngine(model.arch, model.state, tokenizer=model.tokenizer, config=engine_config)
    feedback = None
    if args.feedback_agent:
        reviewer = load_pretrained(args.feedback_agent)
        feedback = NativeEngine(reviewer.arch, reviewer.state, tokenizer=model.tokenizer, config=engine_config)
    messages = args.messages or (line.strip() for line in sys.stdin if line.strip())
    try:
        for message in messages:
            episode = chat_with_feedback(conversation, feedback, model.tokenizer, message, config,
                                         max_new_tokens=args.max_new_tokens, system=args.system)
            if args.jsonl:
                turns = [{"role": t.role, "text": t.text} for t in episode.turns]
                print(json.dumps({"message": message, "reply": episode.responses()[-1].text, "end": episode.end,
                                  "turns": turns}), flush=True)
                continue
            reply = episode.responses()[-1]
            for turn in episode.turns:  # drafts and feedback go to stderr, the reply to stdout
                if turn is not reply:
                    print(f"[{'draft' if turn.role == 'policy' else 'feedback'}] {turn.text}", file=sys.stderr)
            print(reply.text, flush=True)
    finally:
        conversation.close()
        if feedback is not None:
            feedback.close()
    return 0
