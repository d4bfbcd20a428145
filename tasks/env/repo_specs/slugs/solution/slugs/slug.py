import re

_OTHER = re.compile(r"[^a-z0-9]+")


def slugify(text, max_length=50):
    slug = _OTHER.sub("-", text.lower()).strip("-")
    if len(slug) > max_length:
        cut = slug.rfind("-", 0, max_length + 1)
        slug = slug[:cut] if cut > 0 else slug[:max_length]
        slug = slug.rstrip("-")
    return slug


def unique_slug(text, existing):
    base = slugify(text) or "n-a"
    if base not in existing:
        return base
    n = 2
    while f"{base}-{n}" in existing:
        n += 1
    return f"{base}-{n}"
