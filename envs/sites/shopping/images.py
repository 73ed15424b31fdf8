"""Product photos of the shopping site (`envs.sites.common.pictures` draws them): one
pictogram per category, in the product's colour, above its title."""

from functools import lru_cache

from PIL import ImageDraw

from envs.sites.common import pictures
from envs.sites.common.seeding import colour_rgb
from envs.sites.shopping.data import COLOURS

IMAGE_SIZE = pictures.IMAGE_SIZE
OUTLINE = pictures.OUTLINE
__all__ = ["IMAGE_SIZE", "render_product_image"]


def _pot(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    draw.ellipse((90, 60, 210, 160), fill=fill, outline=OUTLINE, width=4)
    draw.rectangle((205, 100, 265, 115), fill=OUTLINE)


def _blocks(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    for x, y in ((100, 100), (160, 100), (130, 45)):
        draw.rectangle((x, y, x + 60, y + 55), fill=fill, outline=OUTLINE, width=4)


def _ball(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    draw.ellipse((105, 45, 215, 155), fill=fill, outline=OUTLINE, width=4)
    draw.arc((105, 45, 215, 155), start=60, end=300, fill=OUTLINE, width=3)


def _bottle(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    draw.rounded_rectangle((135, 60, 185, 165), radius=8, fill=fill, outline=OUTLINE, width=4)
    draw.rectangle((148, 35, 172, 60), fill=OUTLINE)


def _bag(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    draw.polygon((100, 60, 220, 60, 205, 165, 115, 165), fill=fill, outline=OUTLINE)
    draw.line((100, 60, 220, 60), fill=OUTLINE, width=4)


_SHAPES: dict[str, pictures.Shape] = {
    **pictures.COMMON_SHAPES,
    "home-kitchen": _pot,
    "toys-games": _blocks,
    "sports-outdoors": _ball,
    "beauty": _bottle,
    "grocery": _bag,
}


@lru_cache(maxsize=512)
def render_product_image(category: str, colour: str, title: str) -> bytes:
    """PNG bytes of a product photo (IMAGE_SIZE); unknown colours draw grey."""
    fill = colour_rgb(COLOURS, colour)
    return pictures.render_picture(_SHAPES, category, fill, title, (250, 250, 250), 16)
