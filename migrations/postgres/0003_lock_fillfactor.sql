-- cronlease schema v3 for PostgreSQL: every lock row is rewritten at each
-- instant. Pages kept half empty let each update stay on its page (a HOT
-- update) and the old versions be pruned there at once, so the table does
-- not grow between vacuums (or at all where autovacuum is off): with full
-- pages a thousand jobs added a thousand dead rows per instant, and the
-- claim transaction slowed down instant after instant. Pages written before
-- this version fill up as they are rewritten.
ALTER TABLE {prefix}lock_info SET (fillfactor = 50);
