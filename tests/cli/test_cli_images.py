"""Images on the command line: `ninfer generate --image PATH` and `/image PATH` in `ninfer chat`, on the
tiny dense package (random weights with a vision tower), compared with the Engine run directly on the
same decoded images; refusals are one line and (in chat) the session goes on."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from vision_oracle import png

from ninfer import Engine, EngineConfig, GenerationRequest, GenerationResult
from ninfer.cli.main import main
from ninfer.product.media_acquire import MediaPolicy
from ninfer.product.prompt_input import image_part

torch.set_num_threads(1)
STEPS = 6
FLAGS = ("--temperature", "0", "--max-tokens", str(STEPS), "--device", "cpu")
PNG_A = png(70, 40, seed=1)
PNG_B = png(33, 90, seed=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pictures")
    (root / "a.png").write_bytes(PNG_A)
    (root / "b.png").write_bytes(PNG_B)
    (root / "notes.png").write_bytes(b"just some text, not a picture")
    (root / "half.png").write_bytes(PNG_A[: len(PNG_A) // 2])
    return root


@pytest.fixture(scope="module")
def reference(tiny_artifact: Path) -> Any:
    """The Engine as the interactive commands open it (one lane, no warmup)."""
    config = EngineConfig(max_concurrency=1, queue_capacity=1, device="cpu", warmup=False)
    with Engine(tiny_artifact, config) as engine:
        yield engine


def parts(root: Path, *names: str) -> list[dict[str, Any]]:
    return [image_part(name, MediaPolicy(media_root=root)) for name in names]


def direct(engine: Engine, messages: list[dict[str, Any]], max_tokens: int = STEPS) -> GenerationResult:
    request = GenerationRequest(
        messages=messages,
        chat_template_kwargs={"enable_thinking": True},
        temperature=0.0,
        max_tokens=max_tokens,
    )
    return engine.generate(request)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---- generate --image ------------------------------------------------------------------------------------


def test_generate_with_images_gives_the_engine_tokens(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tiny_artifact: Path,
    images: Path,
    reference: Engine,
) -> None:
    monkeypatch.chdir(images)  # a relative path is the user's own file, relative to the working directory
    rc, out, err = run(
        capsys, "generate", str(tiny_artifact), "Compare them.", "--image", "a.png", "--image",
        str(images / "b.png"), "--json", *FLAGS,
    )  # fmt: skip
    assert rc == 0, err
    got = json.loads(out)
    content = [*parts(images, "a.png", "b.png"), {"type": "text", "text": "Compare them."}]
    expected = direct(reference, [{"role": "user", "content": content}])
    assert got["token_ids"] == list(expected.token_ids) and len(got["token_ids"]) == STEPS
    assert got["usage"]["prompt_tokens"] == expected.usage.prompt_tokens > 2 * 64  # the image pads count
    # one image, as a data: URL, with a system message: the same as the Engine again
    url = "data:image/png;base64," + base64.b64encode(PNG_B).decode()
    rc, out, err = run(
        capsys, "generate", str(tiny_artifact), "What is it?", "--image", url, "--system", "Be brief.",
        "--json", *FLAGS,
    )  # fmt: skip
    assert rc == 0, err
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [*parts(images, "b.png"), {"type": "text", "text": "What is it?"}]},
    ]
    assert json.loads(out)["token_ids"] == list(direct(reference, messages).token_ids)
    # negative control: another picture changes the prompt
    assert got["usage"]["prompt_tokens"] != json.loads(out)["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--image", "a.png", "--raw"), "--image needs the chat template"),
        (("--image", "missing.png"), "--image missing.png: no such file"),
        (("--image", "."), "is a directory"),
        (("--image", "notes.png"), "not a supported image"),
        (("--image", "half.png"), "PNG image is truncated or corrupt"),
        (("--image", "http://127.0.0.1:9/a.png"), "give a local file or a data: URL"),
        (("--image", "data:image/png;base64,@@@"), "not valid base64"),
    ],
)
def test_generate_image_refusals_are_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tiny_artifact: Path,
    images: Path,
    argv: tuple[str, ...],
    says: str,
) -> None:
    monkeypatch.chdir(images)
    rc, out, err = run(capsys, "generate", str(tiny_artifact), "What is it?", *argv, *FLAGS)
    assert rc == 1 and out == ""
    assert err.startswith("ninfer: error: ") and err.count("\n") == 1 and says in err, err


def test_generate_image_on_a_model_without_a_vision_tower(
    capsys: pytest.CaptureFixture[str], images: Path
) -> None:
    rc, out, err = run(capsys, "generate", "What is it?", "--image", str(images / "a.png"), *FLAGS)
    assert rc == 1, (out, err)
    assert "no vision tower" in err and err.strip().splitlines()[-1].startswith("ninfer: error: ")


# ---- chat /image -----------------------------------------------------------------------------------------


def test_chat_image_attaches_to_the_next_turn(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tiny_artifact: Path,
    images: Path,
    reference: Engine,
) -> None:
    seen: list[tuple[GenerationRequest, Any]] = []
    real_submit = Engine.submit

    def submit(self: Engine, request: GenerationRequest) -> Any:
        handle = real_submit(self, request)
        seen.append((request, handle))
        return handle

    monkeypatch.setattr(Engine, "submit", submit)
    monkeypatch.chdir(images)
    stdin = "/help\n/image a.png\n/image missing.png\n/image notes.png\n/image\nWhat is it?\nAnd now?\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc, out, err = run(capsys, "chat", str(tiny_artifact), *FLAGS)
    assert rc == 0, err
    assert "/image PATH" in err  # /help lists it
    assert "[image attached: 70 x 40; it goes with your next message (1 attached)]" in err
    assert "ninfer: error: /image missing.png: no such file" in err
    assert "ninfer: error: /image notes.png:" in err and "not a supported image" in err
    assert "[1 image(s) attached to the next message: 70 x 40]" in err
    (first, h1), (second, h2) = seen[0], seen[1]
    assert len(seen) == 2
    a = parts(images, "a.png")
    turn1 = [{"role": "user", "content": [*a, {"type": "text", "text": "What is it?"}]}]
    assert first.messages == turn1
    r1 = h1.result(raise_on_error=False)
    expected = direct(reference, turn1)
    assert r1.token_ids == expected.token_ids and r1.usage.prompt_tokens == expected.usage.prompt_tokens
    # the image stays in the history; the next turn carries none of its own
    history = second.messages
    assert history[0] == turn1[0] and history[-1] == {"role": "user", "content": "And now?"}
    assert history[1]["role"] == "assistant"
    r2 = h2.result(raise_on_error=False)
    assert r2.token_ids == direct(reference, list(history)).token_ids
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens


def test_chat_image_on_a_model_without_a_vision_tower_drops_the_turn(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, images: Path
) -> None:
    stdin = f"/image {images / 'a.png'}\nWhat is it?\nhello\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc, out, err = run(capsys, "chat", *FLAGS)
    assert rc == 0, err
    assert "no vision tower" in err and "its 1 attached image(s) were dropped too" in err
    assert out.strip(), "the next turn (text only) was answered"
