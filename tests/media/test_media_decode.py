"""Image decoding from owned bytes: modes to RGB, EXIF, animation, and every refusal (bombs, truncated,
corrupt, mislabeled, non-images) as a MediaDecodeError naming the cause. Also: no target is imported."""

from __future__ import annotations

import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image
from vision_oracle import encode, noise

from ninfer.media import MediaError
from ninfer.media.decode import DecodedImage, DecodeLimits, MediaDecodeError, decode_image, sniff_image_format


def test_rgb_png_round_trips_exactly() -> None:
    pixels = noise(37, 23, seed=1)
    image = decode_image(encode(Image.fromarray(pixels)))
    assert (image.width, image.height, image.source_format) == (37, 23, "PNG")
    np.testing.assert_array_equal(image.pixels, pixels)
    assert not image.pixels.flags.writeable
    with pytest.raises(ValueError):
        image.pixels[0, 0, 0] = 1


def test_identity_is_the_pixels_not_the_file() -> None:
    pixels = noise(30, 20, seed=2)
    as_png = decode_image(encode(Image.fromarray(pixels), "PNG"))
    as_bmp = decode_image(encode(Image.fromarray(pixels), "BMP"))
    assert as_png == as_bmp and as_png.digest == as_bmp.digest and hash(as_png) == hash(as_bmp)
    changed = pixels.copy()
    changed[0, 0, 0] ^= 1
    assert decode_image(encode(Image.fromarray(changed))).digest != as_png.digest
    # the same pixels transposed are a different image (the size is part of the identity)
    flat = np.zeros((2, 3, 3), np.uint8)
    assert DecodedImage(flat).digest != DecodedImage(flat.reshape(3, 2, 3)).digest


def test_decoded_image_owns_its_pixels() -> None:
    source = noise(8, 8, seed=3)
    image = DecodedImage(source)
    source[:] = 0
    assert image.pixels.any()


def test_alpha_is_composited_onto_white() -> None:
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)  # opaque red
    rgba[0, 1] = (255, 0, 0, 0)  # transparent: white
    rgba[1, 0] = (0, 0, 0, 128)  # half black over white
    image = decode_image(encode(Image.fromarray(rgba, "RGBA")))
    assert image.pixels[0, 0].tolist() == [255, 0, 0]
    assert image.pixels[0, 1].tolist() == [255, 255, 255]
    assert image.pixels[1, 0].tolist() == [127, 127, 127]


def test_grey_palette_and_cmyk_become_rgb() -> None:
    grey = decode_image(encode(Image.fromarray(np.array([[0, 100, 255]], np.uint8), "L")))
    assert grey.pixels.tolist() == [[[0, 0, 0], [100, 100, 100], [255, 255, 255]]]
    palette = Image.new("P", (2, 1))
    palette.putpalette([10, 20, 30, 40, 50, 60])
    palette.putpixel((1, 0), 1)
    assert decode_image(encode(palette)).pixels.tolist() == [[[10, 20, 30], [40, 50, 60]]]
    cmyk = decode_image(encode(Image.new("CMYK", (4, 4), (0, 255, 255, 0)), "JPEG", quality=100))
    red = cmyk.pixels[0, 0].astype(int)
    assert red[0] > 240 and red[1] < 15 and red[2] < 15


def test_sixteen_bit_grey_is_scaled_not_clipped() -> None:
    values = np.array([[0, 257, 32896, 65535]], np.uint16)
    image = decode_image(encode(Image.fromarray(values)))
    assert image.pixels[0, :, 0].tolist() == [0, 1, 128, 255]


def test_exif_orientation_rotates() -> None:
    pixels = np.zeros((10, 30, 3), np.uint8)
    pixels[:, :3] = 255  # a white band on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    image = decode_image(encode(Image.fromarray(pixels), "JPEG", exif=exif.tobytes(), quality=100))
    assert (image.width, image.height) == (10, 30)
    assert image.pixels[:3].mean() > 200 and image.pixels[-3:].mean() < 50  # the band is now on top


def _animated_gif() -> bytes:
    frames = [Image.new("P", (8, 8), color=i) for i in (1, 2, 3)]
    for f in frames:
        f.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=40)


def test_animated_images_give_the_first_frame_or_are_refused() -> None:
    data = _animated_gif()
    image = decode_image(data)
    assert image.animated and image.pixels[0, 0].tolist() == [255, 0, 0]
    with pytest.raises(MediaDecodeError, match="animated GIF images are not accepted") as e:
        decode_image(data, DecodeLimits(animated="refuse"))
    assert e.value.kind == "animated"


def test_pixel_limit_refuses_before_decoding() -> None:
    # a 10000 x 10000 PNG of one colour compresses to a few kB: a decompression bomb in miniature
    bomb = encode(Image.new("L", (10000, 10000)), "PNG")
    assert len(bomb) < 200_000
    with pytest.raises(MediaDecodeError, match=r"10000 x 10000 = 100,000,000 pixels, over the limit") as e:
        decode_image(bomb)
    assert e.value.kind == "too_many_pixels"
    with pytest.raises(MediaDecodeError, match="over the limit of 99 pixels"):
        decode_image(encode(Image.new("RGB", (10, 10))), DecodeLimits(max_pixels=99))
    decode_image(encode(Image.new("RGB", (10, 10))), DecodeLimits(max_pixels=100))


def _png_with_forged_size(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR claims another size (CRC fixed): only the header is lying."""
    data = bytearray(encode(Image.new("RGB", (1, 1))))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[ihdr + 17 : ihdr + 21] = zlib.crc32(bytes(data[ihdr : ihdr + 17])).to_bytes(4, "big")
    return bytes(data)


def test_bomb_with_a_forged_header_is_refused_without_allocating() -> None:
    with pytest.raises(MediaDecodeError, match="9000 x 9000 = 81,000,000 pixels, over the limit") as e:
        decode_image(_png_with_forged_size(9000, 9000))
    assert e.value.kind == "too_many_pixels"
    # beyond twice Pillow's own limit its backstop answers first, with the same kind
    with pytest.raises(MediaDecodeError, match="refused as too large") as e:
        decode_image(_png_with_forged_size(1 << 20, 1 << 20), DecodeLimits(max_pixels=1 << 42))
    assert e.value.kind == "too_many_pixels"
    with pytest.raises(MediaDecodeError, match="truncated or corrupt"):  # a plausible size: data too short
        decode_image(_png_with_forged_size(300, 300))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_truncated_files_are_refused(fmt: str) -> None:
    data = encode(Image.fromarray(noise(64, 64, seed=4)), fmt)
    with pytest.raises(
        MediaDecodeError, match=f"the {fmt} image is truncated or corrupt|not a readable {fmt}"
    ) as e:
        decode_image(data[: len(data) // 2])
    assert e.value.kind == "corrupt"


def test_corrupt_body_is_refused() -> None:
    data = bytearray(encode(Image.fromarray(noise(64, 64, seed=5)), "PNG"))
    data[60:200] = bytes(140)  # wreck the compressed stream (CRCs now wrong)
    with pytest.raises(MediaDecodeError, match="PNG image is truncated or corrupt"):
        decode_image(bytes(data))


@pytest.mark.parametrize(
    "data, head",
    [
        (b"<html><body>not an image</body></html>", "<html>"),
        (b"%PDF-1.7\n...", "%PDF"),
        (b"II*\x00" + bytes(64), "II*"),  # TIFF: not accepted
        (b"\x00\x00\x01\x00" + bytes(64), "\\x00"),  # ICO
    ],
)
def test_non_images_are_refused_naming_the_content(data: bytes, head: str) -> None:
    with pytest.raises(MediaDecodeError, match="not a supported image") as e:
        decode_image(data)
    assert e.value.kind == "not_an_image" and head in str(e.value)
    assert isinstance(e.value, MediaError) and isinstance(e.value, ValueError)


def test_content_decides_the_format_not_the_label() -> None:
    """A JPEG is read as JPEG whatever it was called; a file that only starts like a PNG is refused."""
    jpeg = encode(Image.fromarray(noise(16, 16, seed=6)), "JPEG")
    assert sniff_image_format(jpeg) == "JPEG" and decode_image(jpeg).source_format == "JPEG"
    fake = b"\x89PNG\r\n\x1a\n" + b"this is text pretending to be a png" * 4
    with pytest.raises(MediaDecodeError, match="PNG"):
        decode_image(fake)


def test_empty_and_wrong_types() -> None:
    with pytest.raises(MediaDecodeError, match="empty"):
        decode_image(b"")
    with pytest.raises(TypeError, match="takes bytes"):
        decode_image("data:image/png;base64,AAAA")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pixels"):
        DecodeLimits(max_pixels=0)


def test_errors_pickle_with_their_kind() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(MediaDecodeError("corrupt", "bad bytes")))
    assert isinstance(err, MediaDecodeError) and err.kind == "corrupt" and str(err) == "bad bytes"


def test_media_decode_imports_no_target() -> None:
    code = (
        "import sys, ninfer.media.decode, ninfer.product.media_acquire, ninfer.product.prompt_input\n"
        "bad = [m for m in sys.modules if m.startswith('ninfer.targets')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
