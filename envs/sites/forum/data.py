"""Seeded data of the forum site and the template database built from it.

`build_template_db(path, seed=0)` writes a SQLite file with five tables:

- `forums(id, slug, name, description)`
- `users(id, username, password_hash, joined)` (the fixed test account `agent` included)
- `posts(id, forum_id, user_id, title, body, created, score)`
- `comments(id, post_id, parent_id, user_id, body, created, score)` (`parent_id` NULL for a
  top-level comment, else the top-level comment it replies to: one level of threading)
- `votes(user_id, target, target_id, value)` (`target` is `post` or `comment`, `value` +1 or
  -1; the seeded scores already include everyone's votes, so the table starts empty)

`created` values are ISO timestamps (`2024-03-28T14:05`). Everything is drawn from
`random.Random(seed)` and the fixed SITE_NOW, so the same seed gives the same rows on every
machine; the bundled forum tasks' reference answers depend on seed 0.
"""

import datetime as dt
import hashlib
import random
from pathlib import Path

from envs.sites.common import seeding
from envs.sites.common.accounts import TEST_ACCOUNT

SITE_NOW = dt.datetime(2024, 4, 1, 12, 0)
"""The site's notion of "now": new posts and comments carry it, and "hot" ranks against it."""

FORUMS: list[tuple[str, str, str, int]] = [
    ("bikes", "Bikes", "Road, mountain and city cycling", 26),
    ("books", "Books", "What are you reading?", 18),
    ("cooking", "Cooking", "Recipes, techniques and kitchen gear", 22),
    ("gaming", "Gaming", "Video games and tabletop", 20),
    ("movies", "Movies", "Film news and discussion", 17),
    ("music", "Music", "Listening, playing and gear", 15),
    ("science", "Science", "Research, space and nature", 16),
    ("travel", "Travel", "Trips, tips and itineraries", 16),
]
"""(slug, display name, description, number of seeded posts)."""

TOPICS: dict[str, list[str]] = {
    "bikes": [
        "tubeless tyres",
        "gravel bikes",
        "clipless pedals",
        "bike commuting",
        "chain maintenance",
        "carbon frames",
        "winter riding",
        "bike locks",
        "e-bikes",
        "saddle height",
    ],
    "books": [
        "fantasy series",
        "audiobooks",
        "classic novels",
        "book clubs",
        "e-readers",
        "poetry",
        "science fiction",
        "library apps",
        "short stories",
        "reading goals",
    ],
    "cooking": [
        "sourdough starters",
        "cast iron pans",
        "meal prep",
        "knife sharpening",
        "homemade pasta",
        "spice blends",
        "slow cookers",
        "vegan baking",
        "fermentation",
        "stir fry",
    ],
    "gaming": [
        "indie games",
        "speedrunning",
        "board games",
        "retro consoles",
        "co-op games",
        "game controllers",
        "open world games",
        "puzzle games",
        "mechanical keyboards",
        "tabletop RPGs",
    ],
    "movies": [
        "film noir",
        "animated films",
        "director cuts",
        "film scores",
        "horror classics",
        "documentaries",
        "sequels",
        "cinema snacks",
        "foreign films",
        "movie trailers",
    ],
    "music": [
        "vinyl records",
        "guitar pedals",
        "jazz albums",
        "home recording",
        "music theory",
        "concert tickets",
        "synthesizers",
        "studio headphones",
        "piano practice",
        "playlists",
    ],
    "science": [
        "black holes",
        "CRISPR",
        "climate models",
        "exoplanets",
        "quantum computing",
        "fusion energy",
        "bird migration",
        "volcanoes",
        "the microbiome",
        "particle physics",
    ],
    "travel": [
        "rail passes",
        "packing lists",
        "hostels",
        "travel insurance",
        "road trips",
        "night trains",
        "budget airlines",
        "travel photography",
        "hiking trails",
        "city breaks",
    ],
}
"""Per forum, the topics its post titles are about."""

_TITLE_PATTERNS = [
    "Looking for advice on {t}",
    "What do you think about {t}?",
    "My experience with {t}",
    "Beginner questions about {t}",
    "Is it worth getting into {t}?",
    "Unpopular opinion on {t}",
    "Weekly thread: {t}",
    "Best resources for {t}",
]
_BODY_OPENERS = [
    "I have been reading a lot about {t} lately and would love some input.",
    "After a few months with {t} I have some thoughts to share.",
    "Friends keep recommending {t}, so here I am.",
    "I am completely new to {t} and a bit overwhelmed.",
    "There is so much conflicting information about {t} online.",
    "Starting a thread about {t} since the last one is archived.",
]
_BODY_CLOSERS = [
    "What has worked for you?",
    "Any recommendations are welcome.",
    "Curious to hear other opinions.",
    "Please share your mistakes so I can avoid them.",
    "Links to good guides would be great.",
    "Thanks in advance!",
]
_COMMENT_BODIES = [
    "Great question, I was wondering the same thing.",
    "This is the best advice I have seen in a while.",
    "I tried that last year and it worked well for me.",
    "Strongly disagree, it depends a lot on your budget.",
    "Check the pinned guide, it covers most of this.",
    "Came here to say exactly this.",
    "Honestly the cheap option is fine for most people.",
    "I would wait for the spring sales before buying anything.",
    "Same experience here, it took me weeks to get right.",
    "Could you post an update once you have decided?",
    "The official documentation is surprisingly good.",
    "Start small and build up slowly, that is my tip.",
    "This thread convinced me to finally give it a go.",
    "Watch out for the hidden costs, they add up quickly.",
    "My local club runs free sessions on this.",
    "There is a great video series about this online.",
    "Thanks, this saved me a lot of time.",
    "I keep a spreadsheet of everything I have tried.",
    "Patience is the key, do not rush it.",
    "Ask at your local shop, they usually know best.",
]

USERNAMES: list[str] = [
    "trail_rider",
    "bookworm42",
    "chef_marco",
    "pixel_pilot",
    "cinephile_ann",
    "bass_groove",
    "quark_hunter",
    "wanderlust_j",
    "gear_grinder",
    "page_turner",
    "spice_queen",
    "respawn_ray",
    "film_buff_99",
    "vinyl_vic",
    "lab_rat_lee",
    "nomad_nina",
    "spoke_smith",
    "ink_and_quill",
    "sourdough_sam",
    "loot_goblin",
    "reel_talk",
    "chord_chaser",
    "stellar_sara",
    "backpack_ben",
    "climb_carla",
    "night_owl_ned",
    "retro_rita",
    "frugal_fred",
    "data_dana",
]
"""Seeded users 1-29 (who write every seeded post and comment); the test account is user 30."""

PASSWORD_SALT = "agent-kv-forum"

SCHEMA = """
CREATE TABLE forums (
    id INTEGER PRIMARY KEY, slug TEXT NOT NULL UNIQUE, name TEXT NOT NULL,
    description TEXT NOT NULL
);
CREATE TABLE users (
    id INTEGER PRIMARY KEY, username TEXT NOT NULL UNIQUE, password_hash TEXT NOT NULL,
    joined TEXT NOT NULL
);
CREATE TABLE posts (
    id INTEGER PRIMARY KEY,
    forum_id INTEGER NOT NULL REFERENCES forums(id),
    user_id INTEGER NOT NULL REFERENCES users(id),
    title TEXT NOT NULL,
    body TEXT NOT NULL,
    created TEXT NOT NULL,
    score INTEGER NOT NULL
);
CREATE TABLE comments (
    id INTEGER PRIMARY KEY,
    post_id INTEGER NOT NULL REFERENCES posts(id),
    parent_id INTEGER REFERENCES comments(id),
    user_id INTEGER NOT NULL REFERENCES users(id),
    body TEXT NOT NULL,
    created TEXT NOT NULL,
    score INTEGER NOT NULL
);
CREATE TABLE votes (
    user_id INTEGER NOT NULL REFERENCES users(id),
    target TEXT NOT NULL CHECK (target IN ('post', 'comment')),
    target_id INTEGER NOT NULL,
    value INTEGER NOT NULL CHECK (value IN (-1, 1)),
    PRIMARY KEY (user_id, target, target_id)
);
CREATE INDEX posts_forum ON posts(forum_id);
CREATE INDEX posts_user ON posts(user_id);
CREATE INDEX comments_post ON comments(post_id);
CREATE INDEX comments_user ON comments(user_id);
"""


def password_hash(username: str, password: str) -> str:
    """The stored hash of a password (salted SHA-256; a local test site, not a bank)."""
    return hashlib.sha256(f"{PASSWORD_SALT}:{username}:{password}".encode()).hexdigest()


def _stamp(moment: dt.datetime) -> str:
    """A timestamp as stored: '2024-03-28T14:05'."""
    return moment.isoformat(timespec="minutes")


def generate_posts(seed: int = 0) -> list[dict]:
    """All posts in id order (id = position + 1): forum slug, author, title, body, created,
    score. Titles are unique within a forum. Deterministic in `seed`."""
    rng = random.Random(seed)
    posts = []
    for slug, _, _, count in FORUMS:
        combos = [(p, t) for p in _TITLE_PATTERNS for t in TOPICS[slug]]
        for pattern, topic in rng.sample(combos, count):
            title = pattern.format(t=topic)
            body = " ".join([rng.choice(_BODY_OPENERS).format(t=topic), rng.choice(_BODY_CLOSERS)])
            posts.append(
                {
                    "forum": slug,
                    "author": rng.choice(USERNAMES),
                    "title": title[0].upper() + title[1:],
                    "body": body,
                    "created": SITE_NOW - dt.timedelta(minutes=rng.randint(30, 45 * 24 * 60)),
                    "score": int(rng.expovariate(1 / 25)) - 3,
                }
            )
    rng.shuffle(posts)
    return posts


def generate_comments(posts: list[dict], seed: int = 0) -> list[dict]:
    """Seeded comments in id order: post id, parent (an index into this list or None), author,
    body, created, score. Zero to five top-level comments per post, some with replies."""
    rng = random.Random(seed + 1)
    comments: list[dict] = []
    for post_id, post in enumerate(posts, start=1):
        minutes_left = int((SITE_NOW - post["created"]).total_seconds() // 60)
        for _ in range(rng.choice([0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 5])):
            created = post["created"] + dt.timedelta(minutes=rng.randint(1, minutes_left))
            parent = len(comments)
            comments.append(
                {
                    "post_id": post_id,
                    "parent": None,
                    "author": rng.choice(USERNAMES),
                    "body": rng.choice(_COMMENT_BODIES),
                    "created": created,
                    "score": int(rng.expovariate(1 / 6)) - 1,
                }
            )
            for _ in range(rng.choice([0, 0, 0, 0, 0, 1, 1, 2])):
                left = max(1, int((SITE_NOW - created).total_seconds() // 60))
                comments.append(
                    {
                        "post_id": post_id,
                        "parent": parent,
                        "author": rng.choice(USERNAMES),
                        "body": rng.choice(_COMMENT_BODIES),
                        "created": created + dt.timedelta(minutes=rng.randint(1, left)),
                        "score": int(rng.expovariate(1 / 4)) - 1,
                    }
                )
    return comments


def build_template_db(path: str | Path, seed: int = 0) -> Path:
    """Write the forum template database to `path` (replacing any file there).

    Returns the path. Deterministic in `seed`; takes a few milliseconds.
    """
    # Imported here: envs.server imports this package to register the site.

    posts = generate_posts(seed)
    comments = generate_comments(posts, seed)
    users = [(name, f"{name}-password") for name in USERNAMES]
    users.append((TEST_ACCOUNT["username"], TEST_ACCOUNT["password"]))
    user_ids = {name: i for i, (name, _) in enumerate(users, start=1)}
    forum_ids = {slug: i for i, (slug, _, _, _) in enumerate(FORUMS, start=1)}
    with seeding.template_db(path, SCHEMA) as db:
        db.executemany(
            "INSERT INTO forums (id, slug, name, description) VALUES (?, ?, ?, ?)",
            [(forum_ids[slug], slug, name, text) for slug, name, text, _ in FORUMS],
        )
        db.executemany(
            "INSERT INTO users (id, username, password_hash, joined) VALUES (?, ?, ?, ?)",
            [
                (i, name, password_hash(name, password), f"{2019 + i % 5}-{1 + i % 12:02d}-01")
                for i, (name, password) in enumerate(users, start=1)
            ],
        )
        db.executemany(
            "INSERT INTO posts (id, forum_id, user_id, title, body, created, score)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    i,
                    forum_ids[p["forum"]],
                    user_ids[p["author"]],
                    p["title"],
                    p["body"],
                    _stamp(p["created"]),
                    p["score"],
                )
                for i, p in enumerate(posts, start=1)
            ],
        )
        db.executemany(
            "INSERT INTO comments (id, post_id, parent_id, user_id, body, created, score)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    i,
                    c["post_id"],
                    None if c["parent"] is None else c["parent"] + 1,
                    user_ids[c["author"]],
                    c["body"],
                    _stamp(c["created"]),
                    c["score"],
                )
                for i, c in enumerate(comments, start=1)
            ],
        )
    return Path(path)
