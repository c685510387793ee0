"""The images of a chat request: `image_url` content parts, fetched and decoded under limits.

Sources: `data:` URLs (base64 PNG, JPEG or WebP) and `file://` URLs inside the directory the
operator allowed (`--allowed-local-media-path`, symlinks resolved before the check). http(s)
URLs are refused: the server fetches nothing from the network on a client's behalf (no SSRF,
no waiting on a slow host with a request slot held), and its machines have no internet anyway.

Limits, each a 400 naming the offending part (`messages[0].content[1]`): images per request
(`--limit-mm-per-prompt`), bytes per image file, pixels per image and pixels per request, all
checked from the headers before any bitmap is decoded (a small PNG can unpack to gigabytes);
then the server's pixels in flight (api_server/image_budget.py), a 429 when they are full.
A request's images are decoded once, whatever its `n`: its choices share the pixel arrays.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import urllib.parse
from dataclasses import dataclass
from typing import Any

from api_server.image_budget import ImagePixelBudget, PixelReservation
from api_server.protocol import RequestError
from pipelines.config import MediaLimits

_FORMATS = ("PNG", "JPEG", "WEBP")



@dataclass
class ImagePart:
    """An image of a request, as every API's route hands it to the tokenizer: chat's
    `image_url` parts become these here, and /v1/responses' `input_image` items and
    /v1/messages' `image` blocks are converted into these by their protocol modules (in the
    chat messages' content lists, where no JSON body can put one), so each API's images pass
    the same limits and fail with the same errors, named in that API's own terms."""

    param: str  # where the request holds it, for errors: messages[i].content[j], input[i]...
    url: str  # a data: URL, or a file:// URL checked against --allowed-local-media-path


def take_image_parts(messages: list[dict], limits: MediaLimits,
                     ) -> tuple[list[dict], list[ImagePart]]:
    """The messages with each `image_url` part (or ImagePart) replaced by the chat templates'
    `{"type": "image"}`, and the images in order. Only text and image parts are accepted."""
    parts: list[ImagePart] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        new_content = []
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                new_content.append(part)
            elif kind == "image_url" or isinstance(part, ImagePart):
                image = part if isinstance(part, ImagePart) else \
                    ImagePart(param, _image_url(part, param))
                if len(parts) == limits.max_images:
                    raise RequestError(
                        f"at most {limits.max_images} images per request "
                        f"(--limit-mm-per-prompt)", param=image.param, code="limit_exceeded")
                parts.append(image)
                new_content.append({"type": "image"})
            else:
                raise RequestError(f"unsupported content part of type {kind!r}; this model "
                                   f"takes text and image_url parts", param=param)
        out.append({**message, "content": new_content})
    return out, parts


def _image_url(part: dict, param: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError("an image_url part needs image_url.url", param=param)
    return url


def load_images(parts: list[ImagePart], limits: MediaLimits, budget: ImagePixelBudget,
                ) -> tuple[list[Any], PixelReservation]:
    """A request's images decoded (blocking: run it off the event loop), once each read to
    its header and counted: each image's pixels and the request's total (400), then the
    server's pixels in flight (429). The reservation is the caller's to hold or release."""
    opened = [open_image(read_image_bytes(part, limits), part.param, limits) for part in parts]
    total = 0
    for part, image in zip(parts, opened):
        total += image.size[0] * image.size[1]
        if total > limits.max_request_image_pixels:
            raise RequestError(
                f"the request's images hold more than {limits.max_request_image_pixels} pixels "
                f"together (--max-request-image-pixels)", param=part.param,
                code="limit_exceeded")
    reservation = budget.reserve(total, parts[-1].param if parts else "messages")
    try:
        images = [decode_opened(image, part.param, limits) for part, image in zip(parts, opened)]
    except BaseException:
        reservation.release()
        raise
    budget.on_decoded(len(images))
    return images, reservation


def read_image_bytes(part: ImagePart, limits: MediaLimits) -> bytes:
    url, param = part.url, part.param
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url_bytes(url, param, limits)
    if scheme == "file":
        return _local_file_bytes(url, param, limits)
    if scheme in ("http", "https"):
        raise RequestError("this server does not fetch images from http(s) URLs; send the "
                           "image inline as a data: URL (base64)", param=param,
                           code="unsupported_image_url")
    raise RequestError("an image URL must be a data: URL (base64 PNG, JPEG or WebP) or a "
                       "file:// URL", param=param, code="unsupported_image_url")


def _data_url_bytes(url: str, param: str, limits: MediaLimits) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    media_type = header.split(";", 1)[0].strip().lower()
    if not sep or not header.lower().endswith(";base64"):
        raise RequestError("a data: URL image must be base64 (data:image/png;base64,...)",
                           param=param)
    if media_type and not media_type.startswith("image/"):
        raise RequestError(f"a data: URL of type {media_type!r} is no image", param=param)
    if len(payload) // 4 * 3 > limits.max_image_bytes + 3:  # (decoding would only confirm it)
        raise _too_large(param, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("the image's data: URL is not valid base64", param=param,
                           code="invalid_image") from None
    if len(data) > limits.max_image_bytes:
        raise _too_large(param, limits)
    return data


def _local_file_bytes(url: str, param: str, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise RequestError("this server does not read local files (start it with "
                           "--allowed-local-media-path DIR to allow file:// URLs under DIR)",
                           param=param, code="unsupported_image_url")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise RequestError("a file:// URL must name a local path", param=param)
    path = urllib.parse.unquote(parts.path)
    if "\0" in path:  # no file has one; os.path raises ValueError on it
        raise RequestError("the file:// URL holds a NUL character (%00)", param=param,
                           code="invalid_image_url")
    path = os.path.realpath(path)
    root = os.path.realpath(root)
    if os.path.commonpath([root, path]) != root:
        raise RequestError("the file is outside --allowed-local-media-path", param=param,
                           code="forbidden_path")
    try:
        # O_NOFOLLOW: the resolved path must not have become a symlink since.
        # O_NONBLOCK: a FIFO would block the open until a writer came (refused below).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise RequestError(f"cannot read the image file: {exc.strerror}", param=param) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise RequestError("the image path is not a regular file", param=param)
        data = f.read(limits.max_image_bytes + 1)
    if len(data) > limits.max_image_bytes:
        raise _too_large(param, limits)
    return data


def _too_large(param: str, limits: MediaLimits) -> RequestError:
    return RequestError(f"the image is larger than {limits.max_image_bytes} bytes",
                        param=param, code="limit_exceeded")


def open_image(data: bytes, param: str, limits: MediaLimits) -> Any:
    """The image with only its header read (Pillow decodes lazily), its pixels checked."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data), formats=_FORMATS)
    except Image.DecompressionBombError:
        raise _too_many_pixels(param, limits) from None
    except Exception:  # UnidentifiedImageError and whatever a broken header raises
        raise RequestError("the image is not a PNG, JPEG or WebP image Pillow can read",
                           param=param, code="invalid_image") from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise _too_many_pixels(param, limits)
    return image


def decode_opened(image: Any, param: str, limits: MediaLimits) -> Any:
    """Decode as transformers' `load_image` does (EXIF orientation applied, RGB)."""
    from PIL import Image, ImageOps

    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except Image.DecompressionBombError:
        raise _too_many_pixels(param, limits) from None
    except Exception:  # truncated or corrupt data: OSError, SyntaxError, ValueError, ...
        raise RequestError("the image data is corrupt or truncated", param=param,
                           code="invalid_image") from None


def _too_many_pixels(param: str, limits: MediaLimits) -> RequestError:
    return RequestError(f"the image has more than {limits.max_image_pixels} pixels",
                        param=param, code="limit_exceeded")
