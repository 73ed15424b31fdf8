"""Listing photos of the classifieds site: its categories' pictograms drawn by
`envs.sites.common.pictures` in the listing's colour, with its title."""

from functools import lru_cache

from PIL import ImageDraw

from envs.sites.classifieds.data import COLOURS
from envs.sites.common import pictures
from envs.sites.common.seeding import colour_rgb

IMAGE_SIZE = pictures.IMAGE_SIZE
OUTLINE = pictures.OUTLINE
__all__ = ["IMAGE_SIZE", "render_listing_image"]


def _bike(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    draw.ellipse((50, 70, 130, 150), outline=fill, width=8)
    draw.ellipse((190, 70, 270, 150), outline=fill, width=8)
    draw.line((90, 110, 160, 70, 230, 110, 160, 110, 90, 110), fill=OUTLINE, width=5)


def _table(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    draw.rectangle((70, 60, 250, 110), fill=fill, outline=OUTLINE, width=4)
    draw.rectangle((80, 110, 95, 160), fill=OUTLINE)
    draw.rectangle((225, 110, 240, 160), fill=OUTLINE)


def _car(draw: ImageDraw.ImageDraw, fill: tuple[int, int, int]) -> None:
    draw.rounded_rectangle((50, 80, 270, 140), radius=14, fill=fill, outline=OUTLINE, width=4)
    draw.polygon((100, 80, 130, 45, 200, 45, 230, 80), fill=fill, outline=OUTLINE)
    draw.ellipse((80, 120, 130, 170), fill=OUTLINE)
    draw.ellipse((190, 120, 240, 170), fill=OUTLINE)


_SHAPES: dict[str, pictures.Shape] = {
    **pictures.COMMON_SHAPES,
    "bikes": _bike,
    "furniture": _table,
    "cars": _car,
}


@lru_cache(maxsize=512)
def render_listing_image(category: str, colour: str, title: str) -> bytes:
    """PNG bytes of a listing photo (IMAGE_SIZE); unknown colours draw grey."""
    fill = colour_rgb(COLOURS, colour)
    return pictures.render_picture(_SHAPES, category, fill, title, (248, 246, 240), 18)
