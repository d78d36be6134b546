-- Issue 23, item 4: a node token served on the boot network is ``held``. A certificate issued
-- with it is ``pending`` (it signs nothing that counts) until the site agent that served it
-- confirms the boot entry closed clean (``tokens.confirm``: ``confirmed_at``); a burn revokes it.
ALTER TABLE join_tokens ADD COLUMN held boolean NOT NULL DEFAULT false;
ALTER TABLE join_tokens ADD COLUMN confirmed_at timestamptz;
ALTER TABLE certificates ADD COLUMN pending boolean NOT NULL DEFAULT false;
