"""Image preprocessing equals transformers' Qwen2VLImageProcessorPil (pixel values <= 1e-6, grids equal)
over sizes, aspect ratios, colour modes, EXIF orientations and animation; decoding as ninfer.media.decode
does it, the oracle opening the same bytes the way transformers would."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image
from vision_oracle import FAMILY_DEFAULTS, encode, hf_preprocess, noise, oracle_image, pattern, png

from ninfer.media.decode import decode_image
from ninfer.targets.qwen3_6.frontend.vision import (
    ImagePreprocessError,
    ImageProcessorConfig,
    preprocess_image,
    smart_resize,
)
from ninfer.targets.qwen3_6.variant import VisionDims

TOLERANCE = 1e-6
FAMILY = ImageProcessorConfig.from_json(FAMILY_DEFAULTS)
# a lower max so "huge" inputs take the downscaling branch without 400 MB pixel arrays
LOW_MAX = {**FAMILY_DEFAULTS, "size": {"shortest_edge": 65536, "longest_edge": 1 << 20}}


def check_equal(data: bytes, config: dict = FAMILY_DEFAULTS) -> tuple[int, int, int]:
    ours = preprocess_image(decode_image(data), ImageProcessorConfig.from_json(config))
    pixel_values, grids = hf_preprocess([oracle_image(data)], config)
    assert ours.grid_thw == tuple(grids[0].tolist())
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == pixel_values.shape
    assert not ours.pixel_values.flags.writeable
    err = float(np.abs(ours.pixel_values - pixel_values).max())
    assert err <= TOLERANCE, err
    return ours.grid_thw


@pytest.mark.parametrize(
    "size",
    [(1, 1), (3, 7), (31, 33), (70, 40), (199, 1), (1, 199), (5, 1000), (1000, 5), (333, 517), (1010, 700)],
)
def test_sizes_and_aspect_ratios_match(size: tuple[int, int]) -> None:
    check_equal(png(*size, seed=sum(size)))


@pytest.mark.parametrize("size", [(3000, 2200), (3000, 40)])
def test_huge_images_are_scaled_down_like_transformers(size: tuple[int, int]) -> None:
    t, h, w = check_equal(encode(Image.fromarray(pattern(*size)), "PNG", compress_level=1), LOW_MAX)
    assert h * w * 16 * 16 <= 1 << 20


@pytest.mark.parametrize("size", [(1, 1000), (1000, 1), (2, 500)])
def test_aspect_ratio_over_200_is_refused_like_transformers(size: tuple[int, int]) -> None:
    data = png(*size)
    with pytest.raises(ImagePreprocessError, match="aspect ratio of .* over the limit of 200"):
        preprocess_image(decode_image(data), FAMILY)
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_preprocess([oracle_image(data)])


def _rgba() -> Image.Image:
    rgba = noise(90, 60, seed=5, channels=4)
    rgba[..., 3] = np.linspace(0, 255, 90, dtype=np.uint8)[None, :]  # transparent to opaque
    return Image.fromarray(rgba, "RGBA")


def _palette(transparency: bool) -> Image.Image:
    image = Image.fromarray(noise(64, 48, seed=6)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    if transparency:
        image.info["transparency"] = 3
    return image


@pytest.mark.parametrize(
    "name, image, fmt",
    [
        ("RGBA", _rgba(), "PNG"),
        ("LA", _rgba().convert("LA"), "PNG"),
        ("P", _palette(False), "PNG"),
        ("P+transparency", _palette(True), "PNG"),
        ("P gif", _palette(True), "GIF"),
        ("L", Image.fromarray(noise(50, 80, seed=7, channels=1)[..., 0], "L"), "PNG"),
        ("1", Image.fromarray(noise(50, 80, seed=8, channels=1)[..., 0], "L").convert("1"), "PNG"),
        ("CMYK jpeg", Image.fromarray(noise(64, 64, seed=9)).convert("CMYK"), "JPEG"),
        ("RGB jpeg", Image.fromarray(noise(120, 90, seed=10)), "JPEG"),
        ("RGB webp", Image.fromarray(noise(120, 90, seed=11)), "WEBP"),
        ("RGB bmp", Image.fromarray(noise(41, 29, seed=12)), "BMP"),
        ("RGBA webp", _rgba(), "WEBP"),
    ],
)
def test_colour_modes_match(name: str, image: Image.Image, fmt: str) -> None:
    data = encode(image, fmt)
    if "transparency" in image.info and fmt == "PNG":
        data = encode(image, fmt, transparency=image.info["transparency"])
    check_equal(data)


@pytest.mark.parametrize("orientation", [2, 3, 5, 6, 7, 8])
def test_exif_orientation_is_applied_like_transformers(orientation: int) -> None:
    image = Image.fromarray(noise(96, 40, seed=orientation))
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(image, "JPEG", exif=exif.tobytes())
    decoded = decode_image(data)
    swapped = orientation in (5, 6, 7, 8)
    assert (decoded.width, decoded.height) == ((40, 96) if swapped else (96, 40))
    check_equal(data)


def test_animated_gif_first_frame_matches_transformers() -> None:
    frames = [Image.fromarray(noise(64, 64, seed=s)).convert("P") for s in (1, 2, 3)]
    buf = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert decode_image(buf).animated
    check_equal(buf)


def test_config_without_preprocessor_json_uses_the_family_defaults() -> None:
    config = ImageProcessorConfig.from_json(None)
    assert "family defaults" in config.source
    assert config.identity() == FAMILY.identity()
    assert (config.min_pixels, config.max_pixels, config.patch_size, config.merge_size) == (
        65536,
        16777216,
        16,
        2,
    )
    assert config.image_mean == (0.5, 0.5, 0.5) and config.resample == Image.Resampling.BICUBIC
    assert ImageProcessorConfig.from_json({"patch_size": 16}).source == "preprocessor_config.json"


def test_top_level_min_max_pixels_override_size_like_transformers() -> None:
    legacy = {**FAMILY_DEFAULTS, "min_pixels": 32 * 32 * 3, "max_pixels": 32 * 32 * 9}
    config = ImageProcessorConfig.from_json(legacy)
    assert (config.min_pixels, config.max_pixels) == (3072, 9216)
    check_equal(png(200, 100, seed=1), legacy)


def test_bad_configs_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="image_processor_type 'CLIPImageProcessor'"):
        ImageProcessorConfig.from_json({"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(ValueError, match="patch_size must be an integer"):
        ImageProcessorConfig.from_json({"patch_size": "16"})
    with pytest.raises(ValueError, match="image_std has a zero"):
        ImageProcessorConfig.from_json({"image_std": [0.5, 0, 0.5]})
    with pytest.raises(ValueError, match="do_resize"):
        ImageProcessorConfig.from_json({"do_resize": False})
    vision = VisionDims(
        depth=1, hidden_size=8, num_heads=2, intermediate_size=8, out_hidden_size=8, patch_size=14
    )
    with pytest.raises(ValueError, match="patch_size 16 differs from the vision tower's 14"):
        ImageProcessorConfig.from_json(FAMILY_DEFAULTS, vision)


def test_digest_covers_pixels_and_parameters() -> None:
    a, b = decode_image(png(64, 64, seed=1)), decode_image(png(64, 64, seed=2))
    other = ImageProcessorConfig.from_json({**FAMILY_DEFAULTS, "image_mean": [0.4, 0.5, 0.5]})
    assert (
        preprocess_image(a, FAMILY).digest
        == preprocess_image(decode_image(png(64, 64, seed=1)), FAMILY).digest
    )
    assert preprocess_image(a, FAMILY).digest != preprocess_image(b, FAMILY).digest
    assert preprocess_image(a, FAMILY).digest != preprocess_image(a, other).digest


# ---- negative controls: the oracle comparison catches small mistakes --------------------------------


def _floor_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    return math.floor(height / factor) * factor, math.floor(width / factor) * factor


def test_negative_control_floor_rounding_changes_the_grid() -> None:
    """1010 x 700 sits inside [min, max]: round(1010/32) = 32 but floor = 31."""
    assert smart_resize(700, 1010, 32, 65536, 16777216) != _floor_resize(700, 1010, 32, 65536, 16777216)
    _, grids = hf_preprocess([oracle_image(png(1010, 700))])
    h, w = _floor_resize(700, 1010, 32, 65536, 16777216)
    assert (h // 16, w // 16) != tuple(grids[0].tolist()[1:])


def test_negative_control_bilinear_resampling_is_caught() -> None:
    data = png(333, 517, seed=4)
    pixel_values, _ = hf_preprocess([oracle_image(data)])
    wrong = preprocess_image(
        decode_image(data), ImageProcessorConfig.from_json({**FAMILY_DEFAULTS, "resample": 2})
    )
    assert float(np.abs(wrong.pixel_values - pixel_values).max()) > 1e-3
