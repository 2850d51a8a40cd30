//! Shared by the benchmarks: argument parsing and percentiles.

use crate::support::Backend;

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
