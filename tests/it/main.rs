//! Integration tests: one binary, shared helpers in `support`.
//!
//! They talk to real services on loopback (MariaDB 3306, PostgreSQL 5432,
//! Redis 6379, Redis Sentinel 26379-26381, five Redlock masters 6401-6405,
//! ZooKeeper 2181, etcd 2379 (`.ci/services` starts them all); URLs can be overridden
//! with CRONLEASE_TEST_{MYSQL,POSTGRES,REDIS,SENTINEL,ZOOKEEPER,ETCD}_URL and
//! CRONLEASE_TEST_REDLOCK_URLS (comma-separated). A service that is not there fails its tests with a message
//! saying how to start it. Every test uses its own table or key prefix, so
//! they run in parallel.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod api;
mod cancel;
mod cli;
mod clock;
mod cluster;
mod config_errors;
mod conformance;
mod crontab;
mod dashboard;
mod disk;
mod drill;
mod drill_command;
mod drills;
mod e2e;
mod etcd;
mod handover;
mod hosts;
#[cfg(feature = "memory")]
mod inprocess;
mod jobs;
mod lua_rule;
mod many;
mod migrate;
mod model;
mod outage;
mod output;
mod partition;
mod pidfile;
mod redlock;
mod sentinel;
mod service;
mod stall;
mod support;
mod trigger;
mod webdriver;
mod webhook;
mod zookeeper;
