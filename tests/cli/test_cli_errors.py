"""Every command answers a bad artifact, a bad flag or bad text with one `error:` line on stderr and a
non-zero exit, never a traceback (``--debug`` prints it too)."""

from __future__ import annotations

import io
import json
import struct
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ninfer.artifact.format import PREFIX, PREFIX_SIZE, pack_prefix
from ninfer.cli.main import main

torch.set_num_threads(1)


def _corruptions(data: bytes) -> dict[str, bytes]:
    """The issue's corrupt-artifact cases, made from one good file."""
    _, _, _, json_len, offset = PREFIX.unpack(data[:PREFIX_SIZE])
    header = json.loads(data[PREFIX_SIZE : PREFIX_SIZE + json_len])

    def rewritten(edit: Callable[[dict], None]) -> bytes:
        h = json.loads(json.dumps(header))
        edit(h)
        raw = json.dumps(h, separators=(",", ":")).encode()
        return pack_prefix(raw, offset) + raw + b"\0" * (offset - PREFIX_SIZE - len(raw)) + data[offset:]

    def flipped(at: int) -> bytes:
        out = bytearray(data)
        out[at] ^= 0xFF
        return bytes(out)

    def short_generation_config(h: dict) -> None:
        gc = h["frontend"]["generation_config.json"]
        start = offset + gc["offset"]
        gc["nbytes"], gc["checksum"] = 3, f"crc32:{zlib.crc32(data[start : start + 3]):08x}"

    tokenizer = header["frontend"]["tokenizer.json"]
    return {
        "empty": b"",
        "not_an_artifact": b"hello world\n" * 10,
        "truncated_prefix": data[:20],
        "truncated_payload": data[: len(data) // 2],
        "bad_version": data[:8] + struct.pack("<I", 9) + data[12:],
        "header_checksum": flipped(PREFIX_SIZE + 5),
        "trailing_bytes": data + b"xx",
        "unknown_package": rewritten(lambda h: h["identity"].update(package="nope")),
        "wrong_dims": rewritten(lambda h: h["dims"].update(hidden_size=7)),
        "missing_tensor": rewritten(lambda h: h.update(tensors=h["tensors"][1:])),
        "tokenizer_flipped": flipped(offset + tokenizer["offset"] + 10),
        "no_tokenizer": rewritten(lambda h: h["frontend"].pop("tokenizer.json")),
        "generation_config_not_json": rewritten(short_generation_config),
    }


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory: pytest.TempPathFactory, tiny_artifact: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("corrupt")
    out = {}
    for name, blob in _corruptions(tiny_artifact.read_bytes()).items():
        out[name] = folder / f"{name}.ninfer"
        out[name].write_bytes(blob)
    out["a_directory"] = folder / "dir.ninfer"
    out["a_directory"].mkdir()
    out["missing_file"] = folder / "absent.ninfer"
    return out


def run(capsys: pytest.CaptureFixture[str], *argv: str, stdin: bytes = b"") -> tuple[int, str]:
    """Exit status and stderr of one command (stdin: the given bytes, as a pipe would give them)."""
    capsys.readouterr()
    saved = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's own exit for a bad flag
        rc = int(exc.code or 0)
    finally:
        sys.stdin = saved
    return rc, capsys.readouterr().err


def error_lines(err: str) -> list[str]:
    """stderr less the notes and the verify progress bar: what an error reports."""
    return [line for line in err.splitlines() if "error" in line or "Traceback" in line]


COMMANDS = {
    "generate": lambda path: ("generate", path, "hi", "--raw", "--max-tokens", "1", "--device", "cpu"),
    "score": lambda path: ("score", path, "-", "--device", "cpu"),
    "chat": lambda path: ("chat", path, "--device", "cpu", "--max-tokens", "1"),
    "inspect": lambda path: ("inspect", path, "--verify"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_corrupt_artifacts_give_one_clean_line(
    command: str, corrupt: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    for name, path in corrupt.items():
        rc, err = run(capsys, *COMMANDS[command](str(path)), stdin=b"hi\n")
        lines = error_lines(err)
        assert rc == 1 and len(lines) == 1 and "Traceback" not in err, (name, err[-2000:])
        assert lines[0].startswith(("ninfer: error: ", "ninfer inspect: error: ")), (name, lines)


def test_serve_refuses_corrupt_artifacts_before_listening(
    corrupt: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """(A file whose identity binds but whose tensors do not fails while the server already answers
    /health: /ready reports it; see tests/serve.)"""
    for name in (
        "empty",
        "not_an_artifact",
        "truncated_payload",
        "header_checksum",
        "unknown_package",
        "wrong_dims",
        "tokenizer_flipped",
        "no_tokenizer",
        "a_directory",
        "missing_file",
    ):
        rc, err = run(capsys, "serve", str(corrupt[name]), "--port", "1")
        assert rc == 1 and len(error_lines(err)) == 1 and "Traceback" not in err, (name, err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("generate", "hi", "--max-context", "0", "--device", "cpu"), "max_context must be >= 2"),
        (("score", "-", "--max-context", "0", "--device", "cpu"), "score_window must be >= 2"),
        (("chat", "--max-context", "0", "--device", "cpu"), "max_context must be >= 2"),
        (("generate", "hi", "--temperature", "-1", "--device", "cpu"), "temperature must be"),
        (("serve", "--port", "99999"), "a TCP port is 1..65535, got 99999"),
        (("serve", "--port", "0"), "a TCP port is 1..65535, got 0"),
        (("serve", "--api-key", ""), "the API key is empty or blank"),
        (("serve", "--api-key", "   "), "the API key is empty or blank"),
        (("serve", "--api-key", "two words"), "printable ASCII without spaces"),
        (("serve", "--max-body-bytes", "0"), "max_body_bytes must be an integer >= 1"),
        (("serve", "--body-timeout", "0"), "body_timeout_s must be > 0"),
        (("generate", "--max-tokens", "many", "hi"), "invalid int value"),
    ],
)
def test_bad_flags_give_one_clean_line(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = run(capsys, *argv)
    lines = error_lines(err)
    assert rc != 0 and len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_blank_api_key_from_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NINFER_API_KEY", " ")
    rc, err = run(capsys, "serve")
    assert rc == 1 and "the API key is empty or blank" in err


@pytest.mark.parametrize("mode", [(), ("--raw",)])
@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompts_are_refused_in_both_modes(
    mode: tuple[str, ...], prompt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = run(capsys, "generate", prompt, *mode, "--device", "cpu")
    assert rc == 1 and error_lines(err) == ["ninfer: error: the prompt is empty; give some text"]


def test_undecodable_text_is_one_clean_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes that are not UTF-8: in argv (Python hands them over as lone surrogates), on stdin (score
    and chat; chat refuses the line, goes on with the next and exits 1 at the end)."""
    bad_arg = b"caf\xe9".decode("utf-8", "surrogateescape")
    rc, err = run(capsys, "generate", bad_arg, "--raw", "--device", "cpu")
    assert rc == 1 and "not valid UTF-8 text: undecodable input at character 3 (byte 0xe9)" in err
    rc, err = run(capsys, "score", "-", "--device", "cpu", stdin=b"ok \xff\xfe\n")
    assert rc == 1 and len(error_lines(err)) == 1 and "cannot read -" in err and "Traceback" not in err
    rc, err = run(capsys, "chat", "--device", "cpu", "--max-tokens", "2", stdin=b"\xff bad\ndef f():\n")
    assert rc == 1 and "Traceback" not in err
    assert error_lines(err) == [
        "ninfer: error: the input line is not valid UTF-8 text: undecodable input at character 0 "
        "(byte 0xff); the line was not sent"
    ]


def test_debug_keeps_the_traceback(corrupt: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    path = str(corrupt["header_checksum"])
    for argv in (("--debug", "generate", path, "hi"), ("generate", path, "hi", "--debug")):
        rc, err = run(capsys, *argv)
        assert rc == 1 and "Traceback (most recent call last)" in err and "header checksum mismatch" in err
    rc, err = run(capsys, "generate", path, "hi")
    assert rc == 1 and "Traceback" not in err  # the negative control
