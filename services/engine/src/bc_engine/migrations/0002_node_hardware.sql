-- Discovery (DESIGN section 10): the hardware claims a node's bcd showed when it joined with a
-- discovery token {productUuid, serial, macs, gpuUuids, hostname, certId}. A second discovery of
-- the same hardware (product UUID, else serial) finds the node by them.
ALTER TABLE nodes ADD COLUMN hardware jsonb;
CREATE INDEX nodes_product_uuid ON nodes ((hardware ->> 'productUuid')) WHERE hardware IS NOT NULL;
CREATE INDEX nodes_serial ON nodes ((hardware ->> 'serial')) WHERE hardware IS NOT NULL;
