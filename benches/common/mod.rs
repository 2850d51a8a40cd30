//! Shared by the benchmarks: argument parsing, percentiles, and a daemon's
//! store calls from its `/metrics`.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use crate::support::Backend;

/// Store calls so far, by op, from the daemon's `/metrics` on `port`
/// (`cronlease_store_call_seconds_count`).
#[allow(clippy::unwrap_used)]
pub fn calls(port: u16) -> BTreeMap<String, f64> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("cronlease_store_call_seconds_count{op=\""))
        .filter_map(|l| {
            let (op, rest) = l.split_once('"')?;
            let n = rest.rsplit(' ').next()?.parse().ok()?;
            Some((op.to_string(), n))
        })
        .collect()
}

/// `--name value` from the command line (cargo bench adds a bare `--bench`).
pub fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "options: --stores sqlite,mysql,postgres,redis,sentinel,redlock,zookeeper,etcd  and the benchmark's own (see its source header)"
        );
        std::process::exit(0);
    }
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

pub fn stores() -> Vec<Backend> {
    arg("--stores", "sqlite,mysql,postgres,redis")
        .split(',')
        .map(|s| match s.trim() {
            "sqlite" => Backend::Sqlite,
            "mysql" | "mariadb" => Backend::Mysql,
            "postgres" => Backend::Postgres,
            "redis" => Backend::Redis,
            "sentinel" => Backend::Sentinel,
            "redlock" => Backend::Redlock,
            "zookeeper" | "zk" => Backend::ZooKeeper,
            "etcd" => Backend::Etcd,
            other => panic!("unknown store {other}"),
        })
        .collect()
}

/// (p50, p99, max) of `v`, in the unit given.
pub fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    (at(0.5), at(0.99), v[v.len() - 1])
}
