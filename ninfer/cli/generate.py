"""`ninfer generate [ARTIFACT] PROMPT`: one request through the public Engine, streamed to the terminal.

Without an artifact the bundled demo model runs. Sampling settings the command line leaves out are left to
the Engine, which takes them from the model's generation config (as vLLM does, and as `ninfer serve` and
`ninfer chat` do).

The prompt goes through the package's chat template as one user message (thinking on unless
`--no-think`); `--raw` sends it as plain text instead. `--image PATH` (repeatable) puts images in the
user message before the text (a local file or a data: URL; see ninfer/cli/images.py). Reasoning text is
printed dimmed when stdout is a terminal. `--json` prints one machine-readable result instead of
streaming.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ninfer.cli.common import (
    add_engine_flags,
    add_reuse_flags,
    check_text,
    fail,
    interactive_engine_config,
    product_errors,
    speculative_problem,
    split_artifact,
)
from ninfer.cli.images import image_part

DIM, RESET = "\x1b[2m", "\x1b[0m"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        # argparse would write the one-or-two positionals as "[ARTIFACT] PROMPT [[ARTIFACT] PROMPT ...]"
        usage="%(prog)s [ARTIFACT] PROMPT [options]",
    )
    p.add_argument(
        "positionals",
        nargs="+",
        metavar="[ARTIFACT] PROMPT",
        help="a .ninfer file (default: the bundled demo model) and the prompt text",
    )
    p.add_argument("--raw", action="store_true", help="plain prompt, no chat template")
    p.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="PATH",
        help="an image (a file or a data: URL) in the user message, before the prompt text (repeatable; "
        "needs a model with a vision tower)",
    )
    p.add_argument("--system", default=None, help="system message (chat mode)")
    p.add_argument("--no-think", action="store_true", help="chat template with enable_thinking=false")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="default: the model's generation config")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"text", "token_ids", "finish_reason", "usage"} (and "speculative" with --speculative)',
    )
    add_engine_flags(p)
    add_reuse_flags(p)
    p.set_defaults(func=run)


def build_request(args: argparse.Namespace, images: list[dict[str, Any]] | None = None) -> Any:
    """The request as the command line gives it: sampling flags left out stay ``None`` (model default).
    ``images``: decoded image parts (``--image``), placed before the text."""
    from ninfer import GenerationRequest

    sampling = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )
    if args.raw:
        return GenerationRequest(prompt=args.prompt, **sampling)
    content: Any = [*images, {"type": "text", "text": args.prompt}] if images else args.prompt
    messages = [{"role": "user", "content": content}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    return GenerationRequest(
        messages=messages, chat_template_kwargs={"enable_thinking": not args.no_think}, **sampling
    )


def run(args: argparse.Namespace) -> int:
    from ninfer import Engine, GenerationDelta, GenerationResult
    from ninfer.types import parse_speculative

    artifact, (args.prompt,) = split_artifact(args.positionals, 1, "PROMPT")
    problem = check_text(args.prompt, "the prompt")
    if problem is not None:
        return fail(problem)
    if not args.prompt.strip():  # the same in both modes: a chat turn of nothing is no prompt either
        return fail("the prompt is empty; give some text")
    if args.image and args.raw:
        return fail("--image needs the chat template (an image is a chat content part); drop --raw")
    try:
        images = [image_part(path) for path in args.image or ()]
    except ValueError as e:
        return fail(f"--image {e}")
    try:
        config = interactive_engine_config(args)
        request = build_request(args, images)
        if request.problems():
            return fail("; ".join(request.problems()))
        problem = speculative_problem(artifact, config.speculative)
        if problem is not None:
            return fail(problem)
        engine = Engine(artifact, config)
    except product_errors() as e:
        return fail(e)
    with engine:
        try:
            handle = engine.submit(request)
        except product_errors() as e:
            return fail(e)
        dim = sys.stdout.isatty()
        result: GenerationResult | None = None
        with handle:
            for event in handle:
                if isinstance(event, GenerationDelta) and not args.json:
                    if event.reasoning_text:
                        reasoning = event.reasoning_text
                        sys.stdout.write(f"{DIM}{reasoning}{RESET}" if dim else reasoning)
                    if event.text:
                        sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, GenerationResult):
                    result = event
    assert result is not None
    if result.finish_reason == "error":
        return fail(str(result.error))
    if args.json:
        out = {
            "text": result.text,
            "reasoning_text": result.reasoning_text,
            "tool_calls": [
                {"index": c.index, "id": c.id, "name": c.name, "arguments": c.arguments}
                for c in result.tool_calls
            ],
            "token_ids": list(result.token_ids),
            "finish_reason": result.finish_reason,
            "usage": {
                "prompt_tokens": result.usage.prompt_tokens,
                "completion_tokens": result.usage.completion_tokens,
                "total_tokens": result.usage.total_tokens,
                "cached_tokens": result.usage.reused_prefix_tokens,
            },
        }
        spec = parse_speculative(config.speculative)
        if spec is not None:
            out["speculative"] = {
                "method": spec.method,
                "k": spec.draft_tokens,
                "drafted": result.usage.drafted_tokens,
                "accepted": result.usage.accepted_draft_tokens,
            }
        print(json.dumps(out, ensure_ascii=False))
    else:
        for call in result.tool_calls:
            print(f"\n[tool call] {call.name}({call.arguments})")
        print()
        u = result.usage
        drafts = f"; {u.accepted_draft_tokens}/{u.drafted_tokens} drafts accepted" if u.drafted_tokens else ""
        print(
            f"[{result.finish_reason}; {u.prompt_tokens} prompt ({u.reused_prefix_tokens} cached) + "
            f"{u.completion_tokens} generated tokens{drafts}]",
            file=sys.stderr,
        )
    return 0
