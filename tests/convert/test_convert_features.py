"""Checkpoints without a vision tower or an MTP layer convert with those features off (issue 28).

Real transformers checkpoints of the tiny dense package: the complete one, the same with its
``model.visual.*`` or ``mtp.*`` tensors dropped, and the text model alone as ``Qwen3_5ForCausalLM``
saves it (a text config without ``text_config`` nesting). Each converts, loads and generates; the
text-only artifact decodes exactly the tokens of the complete one (same text weights); a checkpoint
with only some of a feature's tensors is refused naming the missing ones; images and ``mtp:K`` are
refused on an artifact without their weights, by the Engine (per request / at start), the CLI and the
HTTP server.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from convert_ckpt_helpers import (
    Tensors,
    edit_config,
    read_all,
    rewrite_checkpoint,
    save_text_only_checkpoint,
    save_tiny_checkpoint,
)
from ninfer_tools.convert.qwen3_6 import ConvertError, convert

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.artifact import Artifact
from ninfer.cli.main import main as cli_main
from ninfer.product.media_acquire import MediaPolicy
from ninfer.product.prompt_input import acquire_message_media
from ninfer.serve import BackgroundServer, ImageInput, ServeConfig, create_app
from ninfer.targets.identity import check_identity
from ninfer.targets.open import artifact_package, load_frontend
from ninfer.targets.qwen3_6.impl.runtime.backends.plain import PlainDecode
from ninfer.targets.qwen3_6.memory import plan_memory
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)

DENSE, MOE = "qwen3_6_tiny", "qwen3_6_tiny_moe"
PROMPT = "The capital of France is"
STEPS = 8
VISION_LINE = "no vision tower weights (model.visual.*): images are refused"
MTP_LINE = "no MTP weights (mtp.*): --speculative mtp:K is refused"


def config(**kw: Any) -> EngineConfig:
    return EngineConfig(device="cpu", max_concurrency=2, cuda_graphs=False, warmup=False, **kw)


def greedy(artifact: Path) -> tuple[int, ...]:
    with Engine(str(artifact), config()) as engine:
        request = GenerationRequest(prompt=PROMPT, max_tokens=STEPS, temperature=0)
        return engine.generate(request).token_ids


def png_data_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (200, 30, 90)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_messages() -> list[dict[str, Any]]:
    parts = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": png_data_url()}}]
    return [{"role": "system", "content": "Describe images."}, {"role": "user", "content": parts}]


def refused(hf_dir: Path, tmp_path: Path) -> str:
    out = tmp_path / "refused.ninfer"
    with pytest.raises(ConvertError) as info:
        convert(hf_dir, out, progress=False)
    assert not out.exists(), "a refused input left a file behind"
    return str(info.value)


# ---- checkpoints and their artifacts -------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(DENSE, tmp_path_factory.mktemp("hf") / "full", seed=3)


@pytest.fixture(scope="module")
def full_artifact(full_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(full_ckpt, tmp_path_factory.mktemp("out") / "full.ninfer", progress=False)


@pytest.fixture(scope="module")
def text_ckpt(full_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_text_only_checkpoint(DENSE, tmp_path_factory.mktemp("hf") / "text", source=full_ckpt)


@pytest.fixture(scope="module")
def text_artifact(text_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(text_ckpt, tmp_path_factory.mktemp("out") / "text.ninfer", progress=False)


def without(prefix: str) -> Any:
    def edit(tensors: Tensors) -> Tensors:
        return {k: v for k, v in tensors.items() if not k.startswith(prefix)}

    return edit


@pytest.fixture(scope="module")
def no_vision_ckpt(full_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quantizer-style export: the VLM config, but no ``model.visual.*`` tensors."""
    dst = tmp_path_factory.mktemp("hf") / "no_vision"
    return rewrite_checkpoint(full_ckpt, dst, without("model.visual."), touches=lambda k: "visual." in k)


@pytest.fixture(scope="module")
def no_mtp_ckpt(full_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The VLM checkpoint as transformers saves it, without the MTP shard it drops."""
    dst = tmp_path_factory.mktemp("hf") / "no_mtp"
    return rewrite_checkpoint(full_ckpt, dst, without("mtp."), touches=lambda k: k.startswith("mtp."))


@pytest.fixture(scope="module")
def no_vision_artifact(no_vision_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(no_vision_ckpt, tmp_path_factory.mktemp("out") / "no_vision.ninfer", progress=False)


@pytest.fixture(scope="module")
def no_mtp_artifact(no_mtp_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(no_mtp_ckpt, tmp_path_factory.mktemp("out") / "no_mtp.ninfer", progress=False)


# ---- conversion --------------------------------------------------------------------------------------


def test_text_config_only_checkpoint_converts_with_vision_and_mtp_off(
    text_ckpt: Path, full_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = json.loads((text_ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and "text_config" not in cfg
    assert "vision_config" not in cfg and not any(
        k.startswith(("mtp.", "model.visual.")) for k in read_all(text_ckpt)
    )
    capsys.readouterr()
    out = convert(text_ckpt, tmp_path / "text.ninfer", progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "convert qwen3_6_tiny: features off: no vision tower (config.json has no vision_config): images are "
        f"refused; {MTP_LINE}"
    ]
    text, full = Artifact.open(out, verify=True), Artifact.open(full_artifact)
    # the package's name and dims, less its vision tower and MTP layer
    assert text.identity == full.identity
    want = dict(PACKAGES[DENSE].variant.dims(), vision=None, mtp_num_hidden_layers=0)
    assert text.dims == want
    assert set(text.provenance["features_off"]) == {"vision", "mtp"}
    # exactly the text tensors, byte for byte those of the complete checkpoint's artifact
    text_names = [n for n in full.tensor_names() if not n.startswith(("visual.", "mtp."))]
    assert text.tensor_names() == text_names
    for name in text_names:
        assert torch.equal(text.tensor(name).view(torch.uint8), full.tensor(name).view(torch.uint8)), name
    package = check_identity(text)
    assert package.name == DENSE and not package.has_vision and not package.has_mtp
    assert package.features_off == ("vision", "mtp")


@pytest.mark.parametrize(
    ("which", "line", "group"), [("no_vision", VISION_LINE, "visual."), ("no_mtp", MTP_LINE, "mtp.")]
)
def test_a_checkpoint_without_one_feature_converts_without_it(
    which: str, line: str, group: str, request: pytest.FixtureRequest, full_artifact: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    ckpt = request.getfixturevalue(f"{which}_ckpt")
    capsys.readouterr()
    out = convert(ckpt, tmp_path / "a.ninfer", progress=False)
    assert capsys.readouterr().err.strip() == f"convert {DENSE}: features off: {line}"
    artifact, full = Artifact.open(out, verify=True), Artifact.open(full_artifact)
    assert artifact.tensor_names() == [n for n in full.tensor_names() if not n.startswith(group)]
    package = check_identity(artifact)
    assert package.has_vision == (which != "no_vision") and package.has_mtp == (which != "no_mtp")
    assert artifact_package(str(out))[0].features_off == (("vision",) if which == "no_vision" else ("mtp",))


def test_a_complete_checkpoint_keeps_every_feature_and_says_nothing(
    full_ckpt: Path, full_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    out = convert(full_ckpt, tmp_path / "again.ninfer", progress=False)
    assert capsys.readouterr().err == ""
    artifact = Artifact.open(out)
    assert "features_off" not in artifact.provenance and artifact.dims == PACKAGES[DENSE].variant.dims()
    package = check_identity(artifact)
    assert package is PACKAGES[DENSE] and package.has_vision and package.has_mtp


def test_moe_text_config_only_checkpoint_converts_and_generates(tmp_path: Path) -> None:
    ckpt = save_text_only_checkpoint(MOE, tmp_path / "moe_text", seed=5)
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForCausalLM"]
    out = convert(ckpt, tmp_path / "moe_text.ninfer", progress=False)
    package = check_identity(Artifact.open(out, verify=True))
    assert package.name == MOE and package.features_off == ("vision", "mtp")
    assert len(greedy(out)) == STEPS


# ---- partial features are refused ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        ("model.visual.blocks.1.", ["visual.blocks.1.attn.qkv.weight", "visual.blocks.1.norm2.bias"]),
        (
            "mtp.layers.0.self_attn.",
            ["mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_norm.weight"],
        ),
        ("mtp.fc.weight", ["mtp.fc.weight"]),
    ],
    ids=["vision_block", "mtp_attention", "mtp_fc"],
)
def test_some_of_a_features_tensors_is_refused_naming_the_missing(
    full_ckpt: Path, tmp_path: Path, drop: str, named: list[str]
) -> None:
    hf = rewrite_checkpoint(
        full_ckpt, tmp_path / "partial", without(drop), touches=lambda k: k.startswith(drop)
    )
    msg = refused(hf, tmp_path)
    assert "missing" in msg and all(name in msg for name in named), msg


def test_tensors_of_a_feature_the_config_leaves_out_are_refused(no_mtp_ckpt: Path, tmp_path: Path) -> None:
    hf = rewrite_checkpoint(no_mtp_ckpt, tmp_path / "cfg")
    edit_config(hf, lambda c: c.pop("vision_config"))
    msg = refused(hf, tmp_path)
    assert "config.json has no vision_config), yet the checkpoint holds vision tower weights" in msg
    assert "unexpected" in msg and "model.visual.patch_embed.proj.weight" in msg


def test_mtp_layers_zero_in_config_turns_mtp_off(no_mtp_ckpt: Path, tmp_path: Path) -> None:
    hf = rewrite_checkpoint(no_mtp_ckpt, tmp_path / "mtp0")
    edit_config(hf, lambda c: c["text_config"].update(mtp_num_hidden_layers=0))
    artifact = Artifact.open(convert(hf, tmp_path / "mtp0.ninfer", progress=False))
    assert artifact.provenance["features_off"] == {
        "mtp": "no MTP layer (config.json: mtp_num_hidden_layers is 0 or absent)"
    }
    assert check_identity(artifact).features_off == ("mtp",)


def test_a_forced_package_accepts_a_text_config(text_ckpt: Path, text_artifact: Path, tmp_path: Path) -> None:
    out = convert(text_ckpt, tmp_path / "forced.ninfer", package=DENSE, progress=False)
    assert Artifact.open(out).dims == Artifact.open(text_artifact).dims
    with pytest.raises(ConvertError, match=f"do not match package {MOE!r}"):
        convert(text_ckpt, tmp_path / "x.ninfer", package=MOE, progress=False)


# ---- loading and generating -------------------------------------------------------------------------


def test_text_only_artifact_decodes_the_tokens_of_the_complete_one(
    full_artifact: Path, text_artifact: Path, no_vision_artifact: Path, no_mtp_artifact: Path
) -> None:
    want = greedy(full_artifact)
    assert len(want) == STEPS
    assert greedy(text_artifact) == want
    assert greedy(no_vision_artifact) == want
    assert greedy(no_mtp_artifact) == want


def test_no_vision_working_space_without_a_tower(text_artifact: Path) -> None:
    """The image tower's working space is planned only where there is a tower."""
    package, _ = artifact_package(str(text_artifact))
    cuda = dict(device=torch.device("cuda"), dtype=torch.bfloat16, free_bytes=80 << 30, total_bytes=80 << 30)
    engine_config = config(max_image_tokens=16384, max_context=4096)
    full = plan_memory(PACKAGES[DENSE].variant, engine_config, PlainDecode(lookahead=False), **cuda)  # type: ignore[arg-type]
    text = plan_memory(package.variant, engine_config, PlainDecode(lookahead=False), **cuda)  # type: ignore[arg-type]
    assert text.working_bytes < full.working_bytes


def test_the_engine_refuses_an_image_request_alone(no_vision_artifact: Path) -> None:
    from ninfer.types import RequestRejected

    messages = acquire_message_media(image_messages(), MediaPolicy())
    with Engine(str(no_vision_artifact), config()) as engine:
        with pytest.raises(RequestRejected, match="no vision tower"):
            engine.generate(GenerationRequest(messages=messages, max_tokens=2))
        # the Engine is fine: the next (text) request runs
        assert len(engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=2)).token_ids) == 2


def test_the_engine_refuses_mtp_at_start_naming_the_missing_weights(
    no_mtp_artifact: Path, no_vision_artifact: Path
) -> None:
    with pytest.raises(ValueError, match=r"no MTP weights \(mtp\.\*\).*converted from a checkpoint without"):
        Engine(str(no_mtp_artifact), config(speculative="mtp:2"))
    # where the MTP weights are, mtp:K runs (the vision tower is what that artifact lacks)
    with Engine(str(no_vision_artifact), config(speculative="mtp:2")) as engine:
        assert len(engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=3)).token_ids) == 3


# ---- command line and server ----------------------------------------------------------------------------


def test_cli_refuses_mtp_and_inspect_shows_the_features(
    text_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert cli_main(["generate", str(text_artifact), "hi", "--device", "cpu", "--speculative", "mtp:2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"ninfer: error: --speculative mtp:2: the artifact of package {DENSE!r} has no MTP weights (mtp.*): "
        "it was converted from a checkpoint without them; drop --speculative"
    ]
    assert cli_main(["inspect", str(text_artifact)]) == 0
    out = capsys.readouterr().out
    assert "dims match without vision and mtp" in out and "features    vision no, MTP no" in out
    assert MTP_LINE in out and "MTP layers 0, vision no" in out
    assert cli_main(["inspect", "--json", str(text_artifact)]) == 0
    features = json.loads(capsys.readouterr().out)["package"]["features"]
    assert (
        features["vision"] is False and features["mtp"] is False and set(features["off"]) == {"vision", "mtp"}
    )


@pytest.fixture
def server(no_vision_artifact: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """``ninfer serve``'s app over the artifact: images known off from the package (``vision=False``), or
    left to the Engine (``None``)."""
    package, _ = artifact_package(str(no_vision_artifact))
    vision = package.has_vision if request.param == "package" else None
    engine = Engine(str(no_vision_artifact), config())
    images = ImageInput(policy=MediaPolicy(), vision=vision)
    app = create_app(
        lambda: engine,
        ServeConfig(model_name="tiny", images=images),
        frontend=load_frontend(str(no_vision_artifact)),
    )
    srv = BackgroundServer(app)
    srv.start()
    try:
        deadline = time.monotonic() + 120
        while httpx.get(srv.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.1)
        yield srv.url
    finally:
        srv.stop()


@pytest.mark.parametrize("server", ["package", "engine"], indirect=True)
def test_the_server_answers_an_image_with_a_400(server: str, request: pytest.FixtureRequest) -> None:
    url = server + "/v1/chat/completions"
    response = httpx.post(
        url, json={"model": "tiny", "messages": image_messages(), "max_tokens": 2}, timeout=120
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "no vision tower" in error["message"]
    if request.node.callspec.params["server"] == "package":
        # known at startup (``ninfer serve`` reads it from the package): the content part is named
        assert error["param"] == "messages[1].content[1]" and error["code"] == "unsupported_content"
    text = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url, json=text, timeout=120).status_code == 200
