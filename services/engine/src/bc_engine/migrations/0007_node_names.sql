-- Issue 26: an operator's name for a node (`bcx nodes enroll --name lab1-m001`), unique in its
-- site; NULL for a node nobody named. bcx takes it wherever it takes a node id.
ALTER TABLE nodes ADD COLUMN name text;
CREATE UNIQUE INDEX nodes_site_name ON nodes (site_id, name) WHERE name IS NOT NULL;
