-- A workflow step's value meant for the workflow's node (its rendered user data): besides the
-- creating step's live commands, a live command of another step of the same workflow, delivered
-- to that node itself, opens it to that node (the deploy step's image write carries the
-- reference, and bcd writes the user data onto the node's config drive). NULL: the creating
-- step's commands only.
ALTER TABLE secrets ADD COLUMN for_node text;
ALTER TABLE secrets ADD CONSTRAINT secrets_for_node_of_a_workflow CHECK (for_node IS NULL OR workflow_id IS NOT NULL);
