"""Listing photos drawn with Pillow: a category shape in the listing's colour, and its title.

The picture is a pure function of (category slug, colour, title), so it needs no storage and
is byte-identical on every request and machine with the same Pillow version.
"""

import io
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

from envs.sites.classifieds.data import COLOURS

IMAGE_SIZE = (320, 240)
"""(width, height) of every listing photo, in pixels."""
_SHIRT = [(110, 40), (210, 40), (260, 80), (235, 100), (215, 85), (215, 165), (105, 165)]
_SHIRT += [(105, 85), (85, 100), (60, 80)]


def _draw_shape(draw: ImageDraw.ImageDraw, category: str, fill: tuple[int, int, int]) -> None:
    """Draw a simple pictogram of `category` into the upper part of the image."""
    outline = (20, 20, 20)
    if category == "bikes":
        draw.ellipse((50, 70, 130, 150), outline=fill, width=8)
        draw.ellipse((190, 70, 270, 150), outline=fill, width=8)
        draw.line((90, 110, 160, 70, 230, 110, 160, 110, 90, 110), fill=outline, width=5)
    elif category == "electronics":
        draw.rounded_rectangle((80, 40, 240, 140), radius=10, fill=fill, outline=outline, width=4)
        draw.rectangle((140, 140, 180, 160), fill=outline)
    elif category == "furniture":
        draw.rectangle((70, 60, 250, 110), fill=fill, outline=outline, width=4)
        draw.rectangle((80, 110, 95, 160), fill=outline)
        draw.rectangle((225, 110, 240, 160), fill=outline)
    elif category == "cars":
        draw.rounded_rectangle((50, 80, 270, 140), radius=14, fill=fill, outline=outline, width=4)
        draw.polygon((100, 80, 130, 45, 200, 45, 230, 80), fill=fill, outline=outline)
        draw.ellipse((80, 120, 130, 170), fill=outline)
        draw.ellipse((190, 120, 240, 170), fill=outline)
    elif category == "books":
        draw.rectangle((110, 35, 210, 165), fill=fill, outline=outline, width=4)
        draw.line((125, 35, 125, 165), fill=outline, width=4)
    else:
        draw.polygon(_SHIRT, fill=fill, outline=outline)


@lru_cache(maxsize=512)
def render_listing_image(category: str, colour: str, title: str) -> bytes:
    """PNG bytes of a listing photo (IMAGE_SIZE); unknown colours draw grey."""
    fill = COLOURS.get(colour, COLOURS["Grey"])
    image = Image.new("RGB", IMAGE_SIZE, (248, 246, 240))
    draw = ImageDraw.Draw(image)
    _draw_shape(draw, category, fill)
    font = ImageFont.load_default(size=18)
    text_width = draw.textlength(title, font=font)
    draw.text(((IMAGE_SIZE[0] - text_width) / 2, 195), title, fill=(20, 20, 20), font=font)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()
