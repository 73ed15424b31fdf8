"""Product and listing photos drawn with Pillow: a category pictogram in a colour, and a title.

A picture is a pure function of its arguments, so it needs no storage and is byte-identical on
every request and machine with the same Pillow version. Each site maps its category slugs to
pictograms (`Shape`s); the ones several sites use live here.
"""

import io
from collections.abc import Callable

from PIL import Image, ImageDraw, ImageFont

IMAGE_SIZE = (320, 240)
"""(width, height) of every picture, in pixels."""
OUTLINE = (20, 20, 20)
"""Outline and title colour."""
Shape = Callable[[ImageDraw.ImageDraw, tuple[int, int, int]], None]
"""Draws a pictogram filled with an RGB colour into the upper part of the image."""
_SHIRT = [(110, 40), (210, 40), (260, 80), (235, 100), (215, 85), (215, 165), (105, 165)]
_SHIRT += [(105, 85), (85, 100), (60, 80)]


def draw_screen(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    """A screen on a stand (electronics)."""
    draw.rounded_rectangle((80, 40, 240, 140), radius=10, fill=fill, outline=OUTLINE, width=4)
    draw.rectangle((140, 140, 180, 160), fill=OUTLINE)


def draw_book(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    """A book with its spine (books)."""
    draw.rectangle((110, 35, 210, 165), fill=fill, outline=OUTLINE, width=4)
    draw.line((125, 35, 125, 165), fill=OUTLINE, width=4)


def draw_shirt(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    """A T-shirt (clothing, and any category without a pictogram of its own)."""
    draw.polygon(_SHIRT, fill=fill, outline=OUTLINE)


COMMON_SHAPES: dict[str, Shape] = {"electronics": draw_screen, "books": draw_book}
"""Pictograms of the category slugs several sites share."""


def render_picture(
    shapes: dict[str, Shape],
    category: str,
    fill: tuple[int, int, int],
    title: str,
    background: tuple[int, int, int],
    font_size: int,
) -> bytes:
    """PNG bytes (IMAGE_SIZE) of `shapes[category]` (a shirt when missing) filled with `fill`
    on `background`, with `title` centred below in the default font at `font_size`."""
    image = Image.new("RGB", IMAGE_SIZE, background)
    draw = ImageDraw.Draw(image)
    shapes.get(category, draw_shirt)(draw, fill)
    font = ImageFont.load_default(size=font_size)
    text_width = draw.textlength(title, font=font)
    draw.text(((IMAGE_SIZE[0] - text_width) / 2, 195), title, fill=OUTLINE, font=font)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()
