"""Pieces the bundled sites share: the app scaffold and page helpers (`web`), signed-cookie
login (`accounts`), seeded-data helpers (`seeding`) and Pillow pictures (`pictures`)."""
