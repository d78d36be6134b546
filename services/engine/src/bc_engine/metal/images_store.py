"""The image catalog's statements (``images``, ``image_signers``) in the style of ``store``: each
written once, with ``$n`` parameters. ``better_compute.metal.images`` has the one a deploy resolves
an image with (``RESOLVE_IMAGE``)."""

from __future__ import annotations

SIGNER = "SELECT id, algorithm, public_key FROM image_signers WHERE id = $1"
# Engines starting together write the allowlist one after the other, never interleaved.
LOCK_SIGNERS = "LOCK TABLE image_signers IN SHARE ROW EXCLUSIVE MODE"
# The allowlist of one engine's settings replaces the configured part of the table (an
# operator's signers, added_by set, stay): $1 ids, $2 algorithms, $3 keys. A configured signer
# takes over an operator's of the same id.
DROP_OTHER_SIGNERS = "DELETE FROM image_signers WHERE added_by IS NULL AND NOT (id = ANY($1::text[]))"
UPSERT_SIGNERS = """
INSERT INTO image_signers (id, algorithm, public_key)
SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[])
ON CONFLICT (id) DO UPDATE SET algorithm = EXCLUDED.algorithm, public_key = EXCLUDED.public_key,
    added_by = NULL, updated_at = now()
WHERE (image_signers.algorithm, image_signers.public_key, image_signers.added_by) IS DISTINCT FROM
      (EXCLUDED.algorithm, EXCLUDED.public_key, NULL)
"""
# An operator's signer ($4 who): nothing when the id is taken.
ADD_SIGNER = """
INSERT INTO image_signers (id, algorithm, public_key, added_by) VALUES ($1, $2, $3, $4)
ON CONFLICT (id) DO NOTHING RETURNING id, algorithm, added_by, updated_at
"""
REMOVE_SIGNER = (
    "DELETE FROM image_signers WHERE id = $1 AND added_by IS NOT NULL"
    " RETURNING id, algorithm, added_by, updated_at"
)
SIGNER_ROW = "SELECT id, algorithm, added_by, updated_at FROM image_signers WHERE id = $1"
LIST_SIGNERS = "SELECT id, algorithm, added_by, updated_at FROM image_signers ORDER BY id"
# $1 tenant .. $10 public. Nothing when the tenant has that name and version already.
INSERT_IMAGE = """
INSERT INTO images (tenant_id, name, version, url, sha256, format, size, signer, signature, public)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (tenant_id, name, version) DO NOTHING
RETURNING *
"""
OWN_IMAGE = "SELECT * FROM images WHERE tenant_id = $1 AND name = $2 AND version = $3"
DELETE_IMAGE = "DELETE FROM images WHERE tenant_id = $1 AND name = $2 AND version = $3 RETURNING name"
# $1 tenant, $2 name filter, $3-$5 the cursor (name, version, tenant), $6 limit.
LIST_IMAGES = """
SELECT i.*, (s.id IS NOT NULL) AS allowlisted FROM images i
LEFT JOIN image_signers s ON s.id = i.signer
WHERE (i.tenant_id = $1 OR i.public) AND ($2::text IS NULL OR i.name = $2)
  AND ($3::text IS NULL OR (i.name COLLATE "C", i.version COLLATE "C", i.tenant_id COLLATE "C")
                           > ($3, $4::text, $5::text))
ORDER BY i.name COLLATE "C", i.version COLLATE "C", i.tenant_id COLLATE "C"
LIMIT $6
"""
