-- The upgrade drill's schema migration (tests/it/hosts.rs `upgrade`): only a
-- binary made for the drill (examples/upgrade_next.rs, `.ci/deb next`)
-- applies it, as the release after this one would apply its own: one
-- column more, additive, so the same block (binaries of this release claim
-- on it). Never in a release.
ALTER TABLE {prefix}lock_info ADD COLUMN IF NOT EXISTS upgrade_drill TEXT NULL;
