"""Images over HTTP: OpenAI ``image_url`` parts on `ninfer serve`'s app, on the tiny dense package (random
weights and a vision tower, the real Qwen3.6 tokenizer, template and image preprocessing), through the
official `openai` client and raw httpx.

Every answer is compared with the Engine run directly on the same messages acquired by
``acquire_message_media`` (a second Engine on the same artifact), never with a constant. Every refusal
is a 400 naming the part and the cause, the Engine never sees the request, and the server keeps
answering. Remote fetches go to a loopback http.server only.
"""

from __future__ import annotations

import base64
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from PIL import Image
from serve_helpers import MODEL, wait_until
from vision_oracle import encode, noise, png

from ninfer import Engine, EngineConfig, GenerationRequest, GenerationResult
from ninfer.cli.common import bundled_artifact
from ninfer.cli.main import build_parser
from ninfer.cli.serve import serve_config
from ninfer.product.media_acquire import MediaPolicy
from ninfer.product.prompt_input import acquire_message_media
from ninfer.serve import BackgroundServer, ImageInput, ServeConfig, create_app
from ninfer.serve.protocol import ChatCompletionResponse
from ninfer.targets.open import load_frontend

torch.set_num_threads(1)

MAX_CONTEXT = 1024
MAX_IMAGE_TOKENS = 180  # two small images fit (64-80 tokens each), three do not
MAX_BYTES = 1_000_000
MAX_IMAGES = 4
STEPS = 6
PNG_A = png(70, 40, seed=1)
PNG_B = png(33, 90, seed=2)
JPEG_C = encode(Image.fromarray(noise(50, 50, seed=3)), "JPEG")
LOOPBACK = ("127.0.0.1/32",)


def engine_config(max_concurrency: int = 4) -> EngineConfig:
    return EngineConfig(
        device="cpu", max_concurrency=max_concurrency, queue_capacity=16, max_context=MAX_CONTEXT,
        page_size=16, cuda_graphs=False, warmup=False, max_image_tokens=MAX_IMAGE_TOKENS,
    )  # fmt: skip


def data_url(data: bytes, label: str = "image/png") -> str:
    return f"data:{label};base64," + base64.b64encode(data).decode()


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Describe images."}, {"role": "user", "content": list(parts)}]


class Spy:
    """Wraps one Engine's ``submit`` to record what reached it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.requests: list[GenerationRequest] = []
        real = engine.submit

        def submit(request: GenerationRequest) -> Any:
            self.requests.append(request)
            return real(request)

        engine.submit = submit  # type: ignore[method-assign]


@contextlib.contextmanager
def serving(load: Callable[[], Engine], images: ImageInput, frontend: Any) -> Iterator[tuple[str, Spy]]:
    """An app over a fresh Engine (``load()``), served on a thread; yields (base URL, submit spy)."""
    engine = load()
    spy = Spy(engine)
    app = create_app(lambda: engine, ServeConfig(model_name=MODEL, images=images), frontend=frontend)
    server = BackgroundServer(app)
    server.start()
    try:
        wait_until(lambda: httpx.get(server.url + "/ready").status_code == 200, 120)
        yield server.url, spy
    finally:
        server.stop()


# ---- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("media")
    root = base / "root"
    root.mkdir()
    (root / "a.png").write_bytes(PNG_A)
    (root / "sub").mkdir()
    (root / "sub" / "b.png").write_bytes(PNG_B)
    (root / "fake.png").write_bytes(b"<html><body>not an image</body></html>")
    (root / "half.png").write_bytes(PNG_A[: len(PNG_A) // 2])
    (root / "big.png").write_bytes(PNG_A + os.urandom(MAX_BYTES))
    (base / "secret.png").write_bytes(PNG_B)  # outside the root
    (root / "escape.png").symlink_to(base / "secret.png")
    (root / "inside.png").symlink_to(root / "a.png")  # a symlink that stays inside is followed
    return root


@pytest.fixture(scope="module")
def frontend(tiny_artifact: Path) -> Any:
    return load_frontend(tiny_artifact)


@pytest.fixture(scope="module")
def policy(media_root: Path) -> MediaPolicy:
    return MediaPolicy(media_root=media_root, max_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def server(tiny_artifact: Path, frontend: Any, policy: MediaPolicy) -> Iterator[tuple[str, Spy]]:
    images = ImageInput(policy=policy, max_images=MAX_IMAGES, vision=True)
    with serving(lambda: Engine(tiny_artifact, engine_config()), images, frontend) as served:
        yield served


@pytest.fixture(scope="module")
def reference(tiny_artifact: Path) -> Iterator[Engine]:
    """The Engine run directly, one request at a time: what every served answer must equal."""
    with Engine(tiny_artifact, engine_config(max_concurrency=1)) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(server: tuple[str, Spy]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def direct(
    engine: Engine, messages: list[dict[str, Any]], policy: MediaPolicy, **kwargs: Any
) -> GenerationResult:
    acquired = acquire_message_media(messages, policy)
    return engine.generate(GenerationRequest(messages=acquired, max_tokens=STEPS, temperature=0.0, **kwargs))


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions", json={"max_tokens": STEPS, "temperature": 0, **body}, timeout=60
    )


def same_answer(response: dict[str, Any], result: GenerationResult) -> None:
    ChatCompletionResponse.model_validate(response)
    message = response["choices"][0]["message"]
    assert (message["content"] or "", message["reasoning_content"] or "") == (
        result.text,
        result.reasoning_text,
    )
    assert response["usage"]["prompt_tokens"] == result.usage.prompt_tokens
    assert response["usage"]["completion_tokens"] == result.usage.completion_tokens == STEPS


# ---- accepted images -----------------------------------------------------------------------------------


def test_data_url_and_media_root_file_give_the_engine_output(
    client: openai.OpenAI, reference: Engine, policy: MediaPolicy, frontend: Any
) -> None:
    for url in (data_url(PNG_A), "a.png", str(policy.media_root / "sub" / "b.png"), "inside.png"):
        messages = user(text("What is in the picture?"), image(url))
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=STEPS, temperature=0)
        expected = direct(reference, messages, policy)
        same_answer(out.model_dump(exclude_unset=True), expected)
        # prompt_tokens counts the image pad tokens
        prepared = frontend.prepare_chat(acquire_message_media(messages, policy))
        assert out.usage.prompt_tokens == len(prepared.token_ids) > prepared.image_tokens > 0
    different = direct(reference, user(text("What is in the picture?"), image(data_url(PNG_B))), policy)
    assert different.token_ids != expected.token_ids or different.usage != expected.usage  # negative control


def test_two_images_mixed_with_text_string_form_stream_and_mislabeled(
    server: tuple[str, Spy], reference: Engine, policy: MediaPolicy, client: openai.OpenAI
) -> None:
    url, _ = server
    messages = user(text("First"), image(data_url(PNG_A)), text("then"), image("sub/b.png"), text("compare."))
    response = post(url, {"messages": messages})
    assert response.status_code == 200, response.text
    expected = direct(reference, messages, policy)
    same_answer(response.json(), expected)
    assert response.json()["usage"]["prompt_tokens"] > 2 * 64  # both images' pads (64 tokens at least each)

    # the string form of image_url, and a JPEG labeled image/png (the content decides)
    string_form = [dict(m) for m in messages]
    string_form[1] = {
        "role": "user",
        "content": [text("First"), {"type": "image_url", "image_url": data_url(PNG_A)}],
    }
    plain = user(text("First"), image(data_url(PNG_A)))
    response = post(url, {"messages": string_form})
    assert response.status_code == 200, response.text
    same_answer(response.json(), direct(reference, plain, policy))
    mislabeled = user(text("First"), image(data_url(JPEG_C, "image/png")))
    response = post(url, {"messages": mislabeled})
    assert response.status_code == 200, response.text
    same_answer(response.json(), direct(reference, mislabeled, policy))

    # streamed: the same text
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=STEPS, temperature=0, stream=True
    )
    content, reasoning = [], []
    for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
    assert ("".join(content), "".join(reasoning)) == (expected.text, expected.reasoning_text)


def test_image_and_text_requests_together_give_their_single_run_outputs(
    server: tuple[str, Spy], reference: Engine, policy: MediaPolicy
) -> None:
    url, _ = server
    cases = [
        user(text("Case 0")),
        user(text("Case 1"), image(data_url(PNG_A))),
        user(image("sub/b.png"), text("Case 2")),
        user(text("Case 3"), image("a.png"), image(data_url(JPEG_C))),
        [{"role": "user", "content": "Case 4, text only."}],
        user(text("Case 5"), image(data_url(PNG_B))),
        user(text("Case 6"), image("inside.png")),
        user(text("Case 7")),
    ]
    alone = [direct(reference, messages, policy) for messages in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda m: post(url, {"messages": m}), cases))
    for response, expected in zip(together, alone, strict=True):
        assert response.status_code == 200, response.text
        same_answer(response.json(), expected)


# ---- refusals ------------------------------------------------------------------------------------------

HUGE = b"\x89PNG\r\n\x1a\n" + bytes(MAX_BYTES + 10)
BOMB = encode(Image.new("L", (10000, 10000)), "PNG")  # a few kB that decode to 100 MP


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("../secret.png", "contains '..'"),
        ("sub/../../secret.png", "contains '..'"),
        ("escape.png", "leads outside the media root"),
        ("file:///etc/passwd", "file:// URLs are not accepted"),
        ("ftp://example.com/a.png", "scheme 'ftp' are not accepted"),
        ("missing.png", "no image file at 'missing.png'"),
        ("http://127.0.0.1:9/a.png", "remote image URLs are not accepted here"),
        ("https://example.com/a.png", "remote image URLs are not accepted here"),
        ("big.png", f"over the limit of {MAX_BYTES:,} bytes"),
        (data_url(HUGE), f"over the limit of {MAX_BYTES:,} bytes"),
        (data_url(BOMB), "10000 x 10000 = 100,000,000 pixels, over the limit"),
        ("half.png", "PNG image is truncated or corrupt"),
        (data_url(PNG_A[:-30]), "PNG image is truncated or corrupt"),
        ("fake.png", "file content is not a supported image"),
        (data_url(b"GIF89a" + bytes(20)), "not a readable GIF"),
        ("data:image/png;base64,%%%", "not valid base64"),
        ("", "the image reference is empty"),
    ],
)
def test_refusals_are_400_naming_the_part_and_the_cause(server: tuple[str, Spy], url: str, says: str) -> None:
    base, spy = server
    before = len(spy.requests)
    messages = [
        {"role": "system", "content": "Describe images."},
        {"role": "user", "content": [text("Look:"), image(data_url(PNG_A)), image(url)]},
    ]
    response = post(base, {"messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_image" and error["param"] == "messages[1].content[2]", error
    assert error["message"].startswith("messages[1].content[2]: ") and says in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert len(spy.requests) == before, "nothing reached the Engine"
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_request_level_refusals(server: tuple[str, Spy], reference: Engine, policy: MediaPolicy) -> None:
    base, spy = server
    before = len(spy.requests)
    # more images than the server takes per request
    many = user(*[image(data_url(PNG_A)) for _ in range(MAX_IMAGES + 1)])
    error = post(base, {"messages": many}).json()["error"]
    assert (
        error["param"] == f"messages[1].content[{MAX_IMAGES}]"
        and f"more than {MAX_IMAGES} images" in error["message"]
    )
    # images in a system or assistant message
    system = [{"role": "system", "content": [image(data_url(PNG_A))]}, {"role": "user", "content": "hi"}]
    response = post(base, {"messages": system})
    assert response.status_code == 400
    assert "the system message cannot hold images" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages[0].content[0]"
    assistant = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [image(data_url(PNG_A))]},
        {"role": "user", "content": "and?"},
    ]
    response = post(base, {"messages": assistant})
    assert response.status_code == 400
    assert "the assistant message cannot hold images" in response.json()["error"]["message"]
    # other media part types
    audio = user({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}})
    response = post(base, {"messages": audio})
    assert response.status_code == 400 and "input_audio content is not supported" in response.text
    assert len(spy.requests) == before, "nothing reached the Engine"

    # more image tokens than max_image_tokens: the Engine refuses it (it knows the token count)
    three = user(text("Three:"), image(data_url(PNG_A)), image("sub/b.png"), image(data_url(JPEG_C)))
    response = post(base, {"messages": three})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        "max_image_tokens" in error["message"] and f"the {MAX_IMAGE_TOKENS} one request" in error["message"]
    )
    assert error["param"] == "messages"
    # the server is healthy and still answers image requests the same way
    assert httpx.get(base + "/health").json()["status"] == "ok"
    fine = user(text("What is in the picture?"), image(data_url(PNG_A)))
    response = post(base, {"messages": fine})
    same_answer(response.json(), direct(reference, fine, policy))


def test_completions_and_tokenize_refuse_images(server: tuple[str, Spy]) -> None:
    base, spy = server
    before = len(spy.requests)
    for prompt in ([text("hi"), image(data_url(PNG_A))], [image(data_url(PNG_A))]):
        response = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "prompt"
        assert message.startswith("prompt: /v1/completions takes text or token ids, which hold no images")
        assert "/v1/chat/completions" in message
    response = httpx.post(base + "/tokenize", json={"messages": user(text("hi"), image(data_url(PNG_A)))})
    assert response.status_code == 400 and "send images to /v1/chat/completions" in response.text
    assert len(spy.requests) == before


# ---- remote images -------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    routes: dict[str, Any] = {}

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        route = _Handler.routes.get(self.path)
        try:
            if route is None:
                self.send_error(404)
            elif callable(route):
                route(self)
            else:
                self.send_response(200)
                self.send_header("Content-Length", str(len(route)))
                self.send_header("Content-Type", "text/plain")  # ignored: the content is sniffed
                self.end_headers()
                self.wfile.write(route)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _redirect(location: str) -> Callable[[_Handler], None]:
    def route(h: _Handler) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    return route


def _slow(h: _Handler) -> None:
    time.sleep(3.0)  # past the server's media timeout; the fetch has given up by then
    with contextlib.suppress(OSError):
        h.send_response(200)
        h.end_headers()
        h.wfile.write(PNG_A)


HELD = threading.Event()  # set while /held has a request waiting
RELEASE = threading.Event()


def _held(h: _Handler) -> None:
    HELD.set()
    RELEASE.wait(60)
    h.send_response(200)
    h.send_header("Content-Length", str(len(PNG_A)))
    h.end_headers()
    h.wfile.write(PNG_A)


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    port = httpd.server_address[1]
    base = f"http://127.0.0.1:{port}"
    _Handler.routes = {
        "/a.png": PNG_A,
        "/redirect": _redirect("/a.png"),
        "/to-other-loopback": _redirect(f"http://127.0.0.2:{port}/a.png"),
        "/to-metadata": _redirect("http://169.254.169.254/latest/meta-data/"),
        "/to-file": _redirect("file:///etc/passwd"),
        "/slow": _slow,
        "/held": _held,
    }
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield base
    httpd.shutdown()
    httpd.server_close()


def test_remote_images_are_refused_by_default_and_as_loopback(
    server: tuple[str, Spy], image_host: str, tiny_artifact: Path, frontend: Any
) -> None:
    messages = user(text("Remote:"), image(f"{image_host}/a.png"))
    off = post(server[0], {"messages": messages})
    assert off.status_code == 400 and "remote media is turned off" in off.json()["error"]["message"]
    # --allow-remote-media alone: loopback stays refused
    images = ImageInput(policy=MediaPolicy(allow_remote=True), vision=True)
    with serving(lambda: Engine(tiny_artifact, engine_config(1)), images, frontend) as (base, spy):
        response = post(base, {"messages": messages})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages[1].content[1]"
        assert "resolves to 127.0.0.1, a loopback address, which is refused" in error["message"]
        assert not spy.requests and httpx.get(base + "/health").json()["status"] == "ok"


def test_remote_images_from_an_allowed_network(
    image_host: str, tiny_artifact: Path, frontend: Any, reference: Engine
) -> None:
    # the time limit well above a loaded machine's loopback round trips (0.5 s failed once with the CPU
    # shared by two suites) and below the slow route's 3 s
    policy = MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK, timeout_s=1.5, max_bytes=MAX_BYTES)
    images = ImageInput(policy=policy, vision=True)
    with serving(lambda: Engine(tiny_artifact, engine_config(2)), images, frontend) as (base, spy):
        for path in ("/a.png", "/redirect"):
            messages = user(text("Remote:"), image(f"{image_host}{path}"))
            response = post(base, {"messages": messages})
            assert response.status_code == 200, response.text
            same_answer(response.json(), direct(reference, messages, policy))
            # the same pixels as a data: URL give the same answer
            inline = user(text("Remote:"), image(data_url(PNG_A)))
            same_answer(response.json(), direct(reference, inline, MediaPolicy()))
        served = len(spy.requests)
        for path, says in (
            ("/to-other-loopback", "127.0.0.2, a loopback address, which is refused"),
            ("/to-metadata", "169.254.169.254, a link-local address, which is refused"),
            ("/to-file", "not 'file'"),
            ("/missing", "HTTP 404"),
            ("/slow", "time limit"),
        ):
            response = post(base, {"messages": user(text("Remote:"), image(f"{image_host}{path}"))})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "invalid_image" and says in error["message"], (path, error)
            assert error["param"] == "messages[1].content[1]"
        assert len(spy.requests) == served
        assert httpx.get(base + "/health").json()["status"] == "ok"
        response = post(base, {"messages": user(text("Remote:"), image(f"{image_host}/a.png"))})
        assert response.status_code == 200


def test_a_slow_image_host_does_not_stall_other_requests(
    image_host: str, tiny_artifact: Path, frontend: Any
) -> None:
    policy = MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK, timeout_s=60)
    images = ImageInput(policy=policy, vision=True)
    load = lambda: Engine(tiny_artifact, engine_config(2))  # noqa: E731
    with serving(load, images, frontend) as (base, _), ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, base, {"messages": user(image(f"{image_host}/held"))})
        assert HELD.wait(60), "the image host never saw the fetch"
        quick = post(base, {"messages": [{"role": "user", "content": "text while an image downloads"}]})
        assert quick.status_code == 200, quick.text
        assert not held.done(), "the image request waits for its host, off the event loop"
        RELEASE.set()
        assert held.result().status_code == 200


# ---- a model without a vision tower ----------------------------------------------------------------------


@pytest.mark.parametrize("vision", [False, None])
def test_a_model_without_a_vision_tower_refuses_images(vision: bool | None) -> None:
    artifact = bundled_artifact()
    config = EngineConfig(device="cpu", max_concurrency=1, cuda_graphs=False, warmup=False)
    images = ImageInput(policy=MediaPolicy(), vision=vision)
    with serving(lambda: Engine(artifact, config), images, load_frontend(artifact)) as (base, spy):
        response = post(base, {"messages": user(text("Look:"), image(data_url(PNG_A)))})
        assert response.status_code == 400, response.text
        assert "no vision tower" in response.json()["error"]["message"]
        if vision is False:  # known at startup (ninfer serve reads it from the package): refused at once
            assert response.json()["error"]["param"] == "messages[1].content[1]" and not spy.requests
        assert post(base, {"messages": [{"role": "user", "content": "hi"}]}).status_code == 200


# ---- the serve flags -----------------------------------------------------------------------------------


def test_media_flags_build_the_policy(tmp_path: Path) -> None:
    parse = build_parser(only="serve").parse_args
    args = parse(["serve"])
    config = serve_config(args, "m", vision=True)
    assert config.images.policy == MediaPolicy() and config.images.vision is True
    args = parse(
        ["serve", "--media-root", str(tmp_path), "--allow-remote-media", "--allow-media-network",
         "10.1.2.0/24", "--max-image-bytes", "1000", "--media-timeout", "2.5", "--max-images", "3"]
    )  # fmt: skip
    images = serve_config(args, "m").images
    assert images.policy == MediaPolicy(
        media_root=tmp_path, allow_remote=True, allowed_networks=("10.1.2.0/24",), max_bytes=1000,
        timeout_s=2.5,
    )  # fmt: skip
    assert images.max_images == 3 and images.vision is None
    for bad, says in (
        (["--allow-media-network", "10.0.0.0/8"], "needs --allow-remote-media"),
        (["--media-root", str(tmp_path / "nope")], "is not a directory"),
        (["--allow-remote-media", "--allow-media-network", "bogus"], "not a network"),
        (["--max-image-bytes", "0"], "max_bytes must be at least 1"),
        (["--max-images", "0"], "at least 1"),
    ):
        with pytest.raises(ValueError, match=says):
            serve_config(parse(["serve", *bad]), "m")
