//! Shared test helpers: service URLs, unique prefixes, store harnesses and
//! cluster processes.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cronlease::config::{StoreConfig, StoreUrl};
#[cfg(feature = "memory")]
use cronlease::store::memory::MemoryStore;
use cronlease::store::{self, Store};
use sqlx::AssertSqlSafe;

/// A backend under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Mysql,
    Postgres,
    Redis,
    /// Redis through Sentinel, with WAIT for one replica (`.ci/services`
    /// starts a master, two replicas and three sentinels).
    Sentinel,
    /// Redlock over five independent masters (`.ci/services` starts them
    /// on 6401-6405); its "URL" is their URLs joined by commas.
    Redlock,
    /// ZooKeeper (`.ci/services` starts one on 2181).
    ZooKeeper,
    /// etcd (`.ci/services` starts one member on 2379).
    Etcd,
    /// The in-memory store (in-process only: no URL, no daemon).
    Memory,
}

/// The five Redlock masters `.ci/services` starts.
pub const REDLOCK_URLS: &str = "redis://127.0.0.1:6401/,redis://127.0.0.1:6402/,redis://127.0.0.1:6403/,redis://127.0.0.1:6404/,redis://127.0.0.1:6405/";

/// The store URL of `raw`: one URL, or for Redlock its masters' URLs
/// joined by commas.
pub fn store_url(backend: Backend, raw: &str, base: &Path) -> StoreUrl {
    if backend == Backend::Redlock {
        let urls: Vec<&str> = raw.split(',').collect();
        StoreUrl::redlock(&urls).unwrap()
    } else {
        StoreUrl::parse(raw, base).unwrap()
    }
}

/// The master name and sentinels `.ci/services` starts.
pub const SENTINEL_URL: &str =
    "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380,127.0.0.1:26381/cronlease?wait=1";

impl Backend {
    /// Keeps a `format` record rather than a schema table.
    pub fn is_key_value(self) -> bool {
        matches!(
            self,
            Backend::Redis
                | Backend::Sentinel
                | Backend::Redlock
                | Backend::ZooKeeper
                | Backend::Etcd
        )
    }

    /// The backend a per-store test module is named after ([`per_store!`]):
    /// the one place a store's module name meets its backend.
    pub fn named(module: &str) -> Backend {
        match module {
            "sqlite" => Backend::Sqlite,
            "mysql" => Backend::Mysql,
            "postgres" => Backend::Postgres,
            "redis" => Backend::Redis,
            "sentinel" => Backend::Sentinel,
            "redlock" => Backend::Redlock,
            "zookeeper" => Backend::ZooKeeper,
            "etcd" => Backend::Etcd,
            "memory" => Backend::Memory,
            other => panic!("no backend is named {other}"),
        }
    }

    pub fn url(self, dir: &Path) -> String {
        let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
        match self {
            Backend::Sqlite => format!("sqlite://{}", dir.join("locks.db").display()),
            Backend::Mysql => env(
                "CRONLEASE_TEST_MYSQL_URL",
                "mysql://root@127.0.0.1:3306/test",
            ),
            Backend::Postgres => env(
                "CRONLEASE_TEST_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            Backend::Redis => env("CRONLEASE_TEST_REDIS_URL", "redis://127.0.0.1:6379/"),
            Backend::Sentinel => env("CRONLEASE_TEST_SENTINEL_URL", SENTINEL_URL),
            Backend::Redlock => env("CRONLEASE_TEST_REDLOCK_URLS", REDLOCK_URLS),
            Backend::ZooKeeper => env(
                "CRONLEASE_TEST_ZOOKEEPER_URL",
                "zk://127.0.0.1:2181/cronlease-test",
            ),
            Backend::Etcd => env("CRONLEASE_TEST_ETCD_URL", "etcd://127.0.0.1:2379"),
            // Unused: the harness hands out the in-memory store itself.
            Backend::Memory => format!("sqlite://{}", dir.join("unused.db").display()),
        }
    }

    /// Fails the test, saying how to start the service, if it is not there.
    pub fn require(self) {
        let (addr, name, start) = match self {
            Backend::Sqlite | Backend::Memory => return,
            Backend::Mysql => (
                "127.0.0.1:3306",
                "MariaDB",
                "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
            ),
            Backend::Postgres => (
                "127.0.0.1:5432",
                "PostgreSQL",
                "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
            ),
            Backend::Sentinel => (
                "127.0.0.1:26379",
                "Redis Sentinel",
                "bash .ci/services (a master on 6390, replicas on 6391 and 6392, sentinels on 26379-26381)",
            ),
            Backend::Redis => (
                "127.0.0.1:6379",
                "Redis",
                "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no",
            ),
            Backend::ZooKeeper => (
                "127.0.0.1:2181",
                "ZooKeeper",
                "bash .ci/services (installs the Debian package zookeeper and starts it on 2181)",
            ),
            Backend::Etcd => (
                "127.0.0.1:2379",
                "etcd",
                "bash .ci/services (installs the Debian package etcd-server and starts it on 2379)",
            ),
            Backend::Redlock => {
                for port in 6401..=6405 {
                    let addr = format!("127.0.0.1:{port}").parse().unwrap();
                    assert!(
                        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok(),
                        "Redlock master on 127.0.0.1:{port} is not reachable; these tests need five (6401-6405). Start them with: bash .ci/services"
                    );
                }
                // A master counts in no quorum until it has been up for a
                // lease length: the longest lease of the suite is 60 s.
                let urls = self.url(Path::new("/"));
                let urls: Vec<&str> = urls.split(',').collect();
                wait_for_uptime(&urls, 61);
                return;
            }
        };
        let reachable = addr
            .parse()
            .ok()
            .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok())
            .is_some();
        assert!(
            reachable,
            "{name} is not reachable on {addr}; these tests need it. Start it with: {start}"
        );
    }
}

/// Waits until every Redis server of `urls` has been up for `secs` seconds
/// (a Redlock master counts in no quorum before it has been up for a lease).
pub fn wait_for_uptime(urls: &[&str], secs: u64) {
    let uptime = |url: &str| -> u64 {
        let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
        let info: String = redis::cmd("INFO").arg("server").query(&mut c).unwrap();
        info.lines()
            .find_map(|l| l.trim().strip_prefix("uptime_in_seconds:"))
            .and_then(|u| u.parse().ok())
            .unwrap_or(0)
    };
    let least = urls.iter().map(|u| uptime(u)).min().unwrap_or(secs);
    if least < secs {
        eprintln!(
            "waiting {} s for the Redis masters to have been up {secs} s",
            secs - least
        );
        std::thread::sleep(Duration::from_secs(secs - least));
    }
}

/// The long tier (`CRONLEASE_LONG=1`, which `.ci/long` sets): the drills
/// run their long forms. The default tier runs them short, so that the
/// README's test command stays within minutes (docs/testing.md).
pub fn long_tier() -> bool {
    std::env::var("CRONLEASE_LONG").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// A drill's length in seconds: `var` when it is set (a number), else
/// `long` in the long tier and `short` in the default one.
pub fn drill_seconds(var: &str, short: u64, long: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if long_tier() { long } else { short })
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A prefix no other test (or test run) uses.
pub fn unique(tag: &str) -> String {
    let mut r = [0u8; 3];
    getrandom::fill(&mut r).unwrap();
    format!(
        "t{}_{}_{}{:02x}{:02x}{:02x}_",
        tag,
        std::process::id() % 100_000,
        COUNTER.fetch_add(1, Ordering::SeqCst),
        r[0],
        r[1],
        r[2]
    )
}

/// One backend, one namespace: builds store instances (each its own pool,
/// like separate nodes) and tampers with the stored state directly.
pub struct Harness {
    pub backend: Backend,
    pub config: StoreConfig,
    /// The shared state of [`Backend::Memory`].
    #[cfg(feature = "memory")]
    pub memory: Option<MemoryStore>,
    /// Holds the SQLite file for the harness's lifetime.
    _dir: tempfile::TempDir,
}

impl Harness {
    pub async fn new(backend: Backend) -> Harness {
        backend.require();
        let dir = tempfile::tempdir().unwrap();
        let url = store_url(backend, &backend.url(dir.path()), dir.path());
        let mut config = StoreConfig::new(url);
        let prefix = unique(&format!("{backend:?}").to_lowercase()[..2]);
        config.table_prefix = prefix.clone();
        config.key_prefix = format!("cl:{prefix}");
        let h = Harness {
            backend,
            config,
            #[cfg(feature = "memory")]
            memory: (backend == Backend::Memory).then(MemoryStore::new),
            _dir: dir,
        };
        h.store().await.prepare().await.expect("prepare the store");
        h
    }

    /// A harness on an existing store config (for tampering in daemon tests).
    pub fn for_config(config: StoreConfig) -> Harness {
        let backend = match config.url.kind() {
            cronlease::config::StoreKind::Sqlite { .. } => Backend::Sqlite,
            cronlease::config::StoreKind::Mysql => Backend::Mysql,
            cronlease::config::StoreKind::Postgres => Backend::Postgres,
            cronlease::config::StoreKind::Redis => Backend::Redis,
            cronlease::config::StoreKind::RedisSentinel(_) => Backend::Sentinel,
            cronlease::config::StoreKind::Redlock(_) => Backend::Redlock,
            cronlease::config::StoreKind::ZooKeeper(_) => Backend::ZooKeeper,
            cronlease::config::StoreKind::Etcd(_) => Backend::Etcd,
        };
        Harness {
            backend,
            config,
            #[cfg(feature = "memory")]
            memory: None,
            _dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Clients of every Redis server holding the data: the URL's, the
    /// master the sentinels name now, or every Redlock master.
    pub async fn redis_clients(&self) -> Vec<redis::Client> {
        match self.config.url.kind() {
            cronlease::config::StoreKind::Redlock(masters) => masters
                .iter()
                .map(|m| redis::Client::open(m.expose()).unwrap())
                .collect(),
            _ => vec![self.redis_client().await],
        }
    }

    /// A client of the Redis server holding the data: the URL's, or the
    /// master the sentinels name now.
    pub async fn redis_client(&self) -> redis::Client {
        match self.config.url.kind() {
            cronlease::config::StoreKind::RedisSentinel(t) => {
                let (host, port) = &t.sentinels[0];
                let sentinel = redis::Client::open(format!("redis://{host}:{port}/")).unwrap();
                let mut c = sentinel.get_multiplexed_async_connection().await.unwrap();
                let (host, port): (String, u16) = redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&t.master)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                redis::Client::open(format!("redis://{host}:{port}/")).unwrap()
            }
            _ => redis::Client::open(self.config.url.expose()).unwrap(),
        }
    }

    /// A fresh store instance (own connections), as another node would have.
    pub async fn store(&self) -> Arc<dyn Store> {
        #[cfg(feature = "memory")]
        if let Some(memory) = &self.memory {
            return memory.handle();
        }
        store::connect(&self.config).await.unwrap()
    }

    /// Writes history rows this version cannot understand, bypassing
    /// cronlease: an outcome from a newer version (fence 90) and, on Redis,
    /// an entry missing its fields (fence 91), as a hand edit would.
    pub async fn write_foreign_runs(&self, job: &str) {
        #[cfg(feature = "memory")]
        if let Some(memory) = &self.memory {
            let t = cronlease::store::from_ms(1_790_000_000_000);
            memory.insert_raw_run(cronlease::store::RunRecord {
                job: job.into(),
                fence: 90,
                owner: "future#1".into(),
                node: "future".into(),
                occurrence: t,
                started_at: t,
                finished_at: t,
                outcome: cronlease::store::Outcome::parse("exploded"),
                exit_code: None,
                takeover: false,
                delay_ms: 0,
                decision_ms: 0,
                output: String::new(),
                trigger: None,
                cpu_ms: None,
                memory_peak: None,
            });
            return;
        }
        if self.backend == Backend::Etcd {
            let mut etcd = self.etcd().await;
            let runs = format!("{}runs/{job}/", self.config.key_prefix);
            let future = r#"{"job":"JOB","fence":90,"owner":"future#1","node":"future","occurrence":1790000000000,"started_at":1790000000000,"finished_at":1790000000000,"outcome":"exploded","exit_code":null,"takeover":false,"delay_ms":0}"#.replace("JOB", job);
            etcd.put(format!("{runs}{:020}", 90), future, None)
                .await
                .unwrap();
            etcd.put(format!("{runs}{:020}", 91), "{\"garbage\":1", None)
                .await
                .unwrap();
            return;
        }
        if self.backend == Backend::ZooKeeper {
            let zk = self.zk().await;
            let dir = format!("{}/runs/{job}", self.zk_base());
            let opts = zookeeper_client::CreateMode::Persistent
                .with_acls(zookeeper_client::Acls::anyone_all());
            zk.mkdir(&dir, &opts).await.unwrap();
            let future = r#"{"job":"JOB","fence":90,"owner":"future#1","node":"future","occurrence":1790000000000,"started_at":1790000000000,"finished_at":1790000000000,"outcome":"exploded","exit_code":null,"takeover":false,"delay_ms":0}"#.replace("JOB", job);
            zk.create(&format!("{dir}/{:020}", 90), future.as_bytes(), &opts)
                .await
                .unwrap();
            zk.create(&format!("{dir}/{:020}", 91), b"{\"garbage\":1", &opts)
                .await
                .unwrap();
            return;
        }
        match self.backend {
            Backend::Redis | Backend::Sentinel | Backend::Redlock => {
                for client in self.redis_clients().await {
                    let mut c = client.get_multiplexed_async_connection().await.unwrap();
                    let key = format!("{}{{{job}}}:runs", self.config.key_prefix);
                    let _: String = redis::cmd("XADD")
                        .arg(&key)
                        .arg("*")
                        .arg(&[
                            ("job", job),
                            ("fence", "90"),
                            ("owner", "future#1"),
                            ("node", "future"),
                            ("occurrence", "1790000000000"),
                            ("started_at", "1790000000000"),
                            ("finished_at", "1790000000000"),
                            ("outcome", "exploded"),
                            ("takeover", "0"),
                            ("delay_ms", "0"),
                        ])
                        .query_async(&mut c)
                        .await
                        .unwrap();
                    let _: String = redis::cmd("XADD")
                        .arg(&key)
                        .arg("*")
                        .arg(&[("fence", "91"), ("garbage", "yes")])
                        .query_async(&mut c)
                        .await
                        .unwrap();
                }
            }
            _ => {
                let sql = format!(
                    "INSERT INTO {}job_runs (job, fence, owner, node, occurrence, started_at, finished_at, outcome, exit_code, takeover, delay_ms) VALUES ('{job}', 90, 'future#1', 'future', 1790000000000, 1790000000000, 1790000000000, 'exploded', NULL, 0, 0)",
                    self.config.table_prefix
                );
                self.raw_sql(&sql).await;
            }
        }
    }

    /// Sets a job's stored fence, bypassing cronlease (its lock must exist).
    pub async fn set_fence(&self, job: &str, fence: &str) {
        #[cfg(feature = "memory")]
        if let Some(memory) = &self.memory {
            memory.set_fence(job, fence.parse().unwrap());
            return;
        }
        if self.backend == Backend::ZooKeeper {
            self.zk_edit_lock(job, |lock, _| lock["fence"] = fence.into())
                .await;
            return;
        }
        if self.backend == Backend::Etcd {
            self.etcd_edit_lock(job, |lock, _| lock["fence"] = fence.into())
                .await;
            return;
        }
        match self.backend {
            Backend::Redis | Backend::Sentinel | Backend::Redlock => {
                for client in self.redis_clients().await {
                    let mut c = client.get_multiplexed_async_connection().await.unwrap();
                    let key = format!("{}{{{job}}}:state", self.config.key_prefix);
                    let _: i64 = redis::cmd("HSET")
                        .arg(&key)
                        .arg("fence")
                        .arg(fence)
                        .query_async(&mut c)
                        .await
                        .unwrap();
                }
            }
            _ => {
                let sql = format!(
                    "UPDATE {}lock_info SET fence = {fence} WHERE lock_name = '{job}'",
                    self.config.table_prefix
                );
                self.raw_sql(&sql).await;
            }
        }
    }

    /// An etcd client of the harness's own.
    pub async fn etcd(&self) -> etcd_client::Client {
        let cronlease::config::StoreKind::Etcd(t) = self.config.url.kind() else {
            panic!("not an etcd store");
        };
        let endpoints: Vec<String> = t
            .servers
            .iter()
            .map(|(h, p)| format!("http://{h}:{p}"))
            .collect();
        etcd_client::Client::connect(endpoints, None).await.unwrap()
    }

    /// Rewrites a job's etcd state key with `edit(json, now_ms)`.
    async fn etcd_edit_lock(&self, job: &str, edit: impl FnOnce(&mut serde_json::Value, i64)) {
        let mut etcd = self.etcd().await;
        let key = format!("{}lock/{job}", self.config.key_prefix);
        let got = etcd.get(key.as_str(), None).await.unwrap();
        let kv = &got.kvs()[0];
        let mut lock: serde_json::Value = serde_json::from_slice(kv.value()).unwrap();
        edit(&mut lock, chrono::Utc::now().timestamp_millis());
        etcd.put(key, serde_json::to_vec(&lock).unwrap(), None)
            .await
            .unwrap();
    }

    /// A ZooKeeper session of the harness's own (no chroot).
    pub async fn zk(&self) -> zookeeper_client::Client {
        let cronlease::config::StoreKind::ZooKeeper(t) = self.config.url.kind() else {
            panic!("not a ZooKeeper store");
        };
        let servers: Vec<String> = t.servers.iter().map(|(h, p)| format!("{h}:{p}")).collect();
        zookeeper_client::Client::connect(&servers.join(","))
            .await
            .unwrap()
    }

    /// The node under which the ZooKeeper store keeps this harness's nodes.
    pub fn zk_base(&self) -> String {
        let cronlease::config::StoreKind::ZooKeeper(t) = self.config.url.kind() else {
            panic!("not a ZooKeeper store");
        };
        let node = self
            .config
            .key_prefix
            .trim_end_matches(':')
            .replace('/', "_");
        format!("{}/{node}", t.chroot.trim_end_matches('/'))
    }

    /// Rewrites a job's ZooKeeper lock node with `edit(json, store_now_ms)`.
    async fn zk_edit_lock(&self, job: &str, edit: impl FnOnce(&mut serde_json::Value, i64)) {
        let zk = self.zk().await;
        let base = self.zk_base();
        let now = zk
            .set_data(&format!("{base}/clock"), b"", None)
            .await
            .unwrap()
            .mtime;
        let path = format!("{base}/locks/{job}");
        let (data, stat) = zk.get_data(&path).await.unwrap();
        let mut lock: serde_json::Value = serde_json::from_slice(&data).unwrap();
        edit(&mut lock, now);
        zk.set_data(
            &path,
            &serde_json::to_vec(&lock).unwrap(),
            Some(stat.version),
        )
        .await
        .unwrap();
    }

    /// Runs one SQL statement on the harness's database, bypassing cronlease.
    /// Records the store's schema (SQL) or record format (key-value
    /// stores) as `version`, as a newer binary or a stray write would;
    /// SQL takes numbers only.
    pub async fn write_format(&self, version: &str) {
        #[cfg(feature = "memory")]
        if let Some(memory) = &self.memory {
            memory.set_format(version.parse().unwrap());
            return;
        }
        match self.backend {
            Backend::Sqlite | Backend::Mysql | Backend::Postgres => {
                self.raw_sql(&format!(
                    "INSERT INTO {}cronlease_schema (version, applied_at) VALUES ({version}, 0)",
                    self.config.table_prefix
                ))
                .await;
            }
            Backend::Redis | Backend::Sentinel | Backend::Redlock => {
                for client in self.redis_clients().await {
                    let mut c = client.get_multiplexed_async_connection().await.unwrap();
                    let key = format!("{}format", self.config.key_prefix);
                    let _: () = redis::cmd("SET")
                        .arg(&key)
                        .arg(version)
                        .query_async(&mut c)
                        .await
                        .unwrap();
                }
            }
            Backend::Etcd => {
                let key = format!("{}format", self.config.key_prefix);
                self.etcd().await.put(key, version, None).await.unwrap();
            }
            Backend::ZooKeeper => {
                let path = format!("{}/format", self.zk_base());
                self.zk()
                    .await
                    .set_data(&path, version.as_bytes(), None)
                    .await
                    .unwrap();
            }
            #[allow(unreachable_patterns)]
            _ => panic!("no format record on {:?}", self.backend),
        }
    }

    pub async fn raw_sql(&self, sql: &str) {
        sqlx::any::install_default_drivers();
        let url = match self.config.url.kind() {
            cronlease::config::StoreKind::Sqlite { path } => format!("sqlite://{}", path.display()),
            _ => self.config.url.expose().to_string(),
        };
        let mut conn = <sqlx::AnyConnection as sqlx::Connection>::connect(&url)
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(sql.to_string()))
            .execute(&mut conn)
            .await
            .unwrap();
    }

    /// Sets the job's lease to expire `ms` from now on the **store's** clock
    /// (negative: already expired), bypassing cronlease.
    pub async fn set_expiry_in(&self, job: &str, ms: i64) {
        #[cfg(feature = "memory")]
        if let Some(memory) = &self.memory {
            memory.set_expiry_in(job, ms);
            return;
        }
        // SQLite's store clock is a file's mtime, which the kernel stamps
        // from its coarse clock (a few ms behind julianday('now')): make an
        // expiry in the past clearly past.
        let ms = if self.backend == Backend::Sqlite && ms <= 0 {
            ms.min(-50)
        } else {
            ms
        };
        if self.backend == Backend::Etcd {
            // The lease key records the lease's end; its etcd lease must
            // outlive that (it was granted for the old one).
            let mut etcd = self.etcd().await;
            let key = format!("{}lease/{job}", self.config.key_prefix);
            let got = etcd.get(key.as_str(), None).await.unwrap();
            let mut lease: serde_json::Value =
                serde_json::from_slice(got.kvs()[0].value()).unwrap();
            lease["expires_at"] = (chrono::Utc::now().timestamp_millis() + ms).into();
            let ttl = ((ms + 999) / 1000).max(2);
            let id = etcd.lease_grant(ttl, None).await.unwrap().id();
            let opts = etcd_client::PutOptions::new().with_lease(id);
            etcd.put(key, serde_json::to_vec(&lease).unwrap(), Some(opts))
                .await
                .unwrap();
            return;
        }
        if self.backend == Backend::ZooKeeper {
            self.zk_edit_lock(job, |lock, now| lock["expires_at"] = (now + ms).into())
                .await;
            if ms <= 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            return;
        }
        match self.backend {
            Backend::Redis | Backend::Sentinel | Backend::Redlock => {
                for client in self.redis_clients().await {
                    let mut c = client.get_multiplexed_async_connection().await.unwrap();
                    let key = format!("{}{{{job}}}:lease", self.config.key_prefix);
                    let _: i64 = redis::cmd("PEXPIRE")
                        .arg(&key)
                        .arg(ms.max(1))
                        .query_async(&mut c)
                        .await
                        .unwrap();
                }
                if ms <= 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            _ => {
                sqlx::any::install_default_drivers();
                let url = match self.config.url.kind() {
                    cronlease::config::StoreKind::Sqlite { path } => {
                        format!("sqlite://{}", path.display())
                    }
                    _ => self.config.url.expose().to_string(),
                };
                let now = match self.backend {
                    Backend::Sqlite => {
                        "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"
                    }
                    Backend::Mysql => {
                        "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
                    }
                    _ => "(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT)",
                };
                let mut conn = <sqlx::AnyConnection as sqlx::Connection>::connect(&url)
                    .await
                    .unwrap();
                let sql = format!(
                    "UPDATE {}lock_info SET expires_at = {now} + ({ms}) WHERE lock_name = '{job}'",
                    self.config.table_prefix
                );
                sqlx::raw_sql(AssertSqlSafe(sql))
                    .execute(&mut conn)
                    .await
                    .unwrap();
            }
        }
    }
}

/// Polls `probe` every 20 ms until it gives a value; after `limit`, fails
/// the test naming `what`, with `context()` (a cluster's report, say).
pub fn wait_until<T>(
    what: &str,
    limit: Duration,
    context: impl Fn() -> String,
    mut probe: impl FnMut() -> Option<T>,
) -> T {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The cronlease binary built for these tests.
/// Every process id listed in `/proc`.
pub fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The fields of `/proc/PID/stat` after the command name: state, ppid,
/// pgrp, ..., utime at index 11, stime at 12. Empty when the process is gone.
pub fn proc_stat(pid: i32) -> Vec<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// The daemon under test: this build's, or for a benchmark's before/after
/// table the one `CRONLEASE_BENCH_BIN` names.
pub fn binary() -> PathBuf {
    std::env::var_os("CRONLEASE_BENCH_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_cronlease")),
        PathBuf::from,
    )
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A Redis server of the test's own, which it may stop and start.
pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
    persistent: bool,
}

impl RedisServer {
    /// Prepares a server on a free port, not yet started. A persistent one
    /// keeps an AOF with `appendfsync always` (what docs/protocol.md asks) across
    /// restarts; the other forgets everything.
    pub fn new(persistent: bool) -> RedisServer {
        RedisServer {
            port: free_port(),
            dir: tempfile::tempdir().unwrap(),
            child: None,
            persistent,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Starts it (no persistence) and waits until it accepts connections.
    pub fn start(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(if self.persistent {
                ["--appendonly", "yes", "--appendfsync", "always"]
            } else {
                ["--appendonly", "no", "--appendfsync", "no"]
            })
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server must be installed (Debian package redis-server)");
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port).parse().unwrap();
        for _ in 0..100 {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server on port {} did not start", self.port);
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// Kills it (SIGKILL: an abrupt outage).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A MariaDB server of the test's own (its own data directory and port), which
/// it may kill and start again; InnoDB keeps what it acknowledged.
pub struct MariaDbServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
    /// Extra server options (TLS files, say).
    pub extra_args: Vec<String>,
}

impl MariaDbServer {
    /// Initialises a data directory (`mariadb-install-db`), not yet started.
    pub fn new() -> MariaDbServer {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new("mariadb-install-db")
            .args([
                "--no-defaults",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ])
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            .output()
            .expect("mariadb-install-db must be installed (Debian package mariadb-server)");
        assert!(
            out.status.success(),
            "mariadb-install-db: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        MariaDbServer {
            port: free_port(),
            dir,
            child: None,
            extra_args: Vec::new(),
        }
    }

    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// Starts it and waits until it answers; creates database `test`.
    pub fn start(&mut self) {
        let d = self.dir.path();
        let child = std::process::Command::new("/usr/sbin/mariadbd")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", d.join("data").display()))
            .arg(format!("--socket={}", d.join("sock").display()))
            .arg(format!("--pid-file={}", d.join("pid").display()))
            .arg(format!("--port={}", self.port))
            .args([
                "--bind-address=127.0.0.1",
                "--user=root",
                "--skip-grant-tables",
                "--innodb-buffer-pool-size=16M",
                "--skip-log-bin",
            ])
            .args(&self.extra_args)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(d.join("server.log")).unwrap())
            .spawn()
            .unwrap();
        self.child = Some(child);
        for _ in 0..200 {
            let ok = std::process::Command::new("mariadb")
                .arg(format!("--socket={}", d.join("sock").display()))
                .args(["-uroot", "-e", "CREATE DATABASE IF NOT EXISTS test"])
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("mariadbd on port {} did not start", self.port);
    }

    /// Kills it (SIGKILL: an abrupt outage).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A test CA (`ca.pem`), a server certificate it signs for 127.0.0.1
/// (`server.pem`, `server.key`), and an unrelated CA (`other.pem`), in `dir`.
pub fn make_certs(dir: &std::path::Path) {
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .current_dir(dir)
            .args(args)
            .output()
            .expect("openssl must be installed");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    for ca in ["ca", "other"] {
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{ca}.key"),
            "-out",
            &format!("{ca}.pem"),
            "-days",
            "2",
            "-subj",
            &format!("/CN=cronlease test {ca}"),
        ]);
    }
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
}

/// A PostgreSQL server of the test's own, run as the `postgres` user (it
/// refuses root) from a data directory the test initialises.
pub struct PgServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
    bin: std::path::PathBuf,
    /// `-c name=value` server settings.
    pub settings: Vec<String>,
}

impl PgServer {
    pub fn new() -> PgServer {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL server binaries under /usr/lib/postgresql")
            .flatten()
            .map(|e| e.path().join("bin"))
            .find(|p| p.join("postgres").exists())
            .expect("a postgres binary");
        let dir = tempfile::tempdir().unwrap();
        let pg = nix::unistd::User::from_name("postgres")
            .unwrap()
            .expect("a postgres user");
        std::os::unix::fs::chown(dir.path(), Some(pg.uid.as_raw()), Some(pg.gid.as_raw())).unwrap();
        let out = std::process::Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(dir.path().join("data"))
            .output()
            .expect("runuser and initdb");
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PgServer {
            port: free_port(),
            dir,
            child: None,
            bin,
            settings: Vec::new(),
        }
    }

    /// Copies a file into the server's directory, owned by postgres, mode 0600.
    pub fn install(&self, from: &std::path::Path, name: &str) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let to = self.dir.path().join(name);
        std::fs::copy(from, &to).unwrap();
        let pg = nix::unistd::User::from_name("postgres").unwrap().unwrap();
        std::os::unix::fs::chown(&to, Some(pg.uid.as_raw()), Some(pg.gid.as_raw())).unwrap();
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600)).unwrap();
        to
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn start(&mut self) {
        let mut cmd = std::process::Command::new("runuser");
        cmd.args(["-u", "postgres", "--"])
            .arg(self.bin.join("postgres"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args([
                "-p",
                &self.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
            ])
            .arg("-k")
            .arg(self.dir.path());
        for s in &self.settings {
            cmd.args(["-c", s]);
        }
        self.child = Some(
            cmd.stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        let addr = format!("127.0.0.1:{}", self.port).parse().unwrap();
        for _ in 0..200 {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
                std::thread::sleep(Duration::from_millis(200));
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("postgres on port {} did not start", self.port);
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // runuser forwards SIGTERM to postgres (a fast shutdown).
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = c.wait();
        }
    }
}

/// The one way a scenario runs per store: `per_store!([sqlite, redis];
/// a, b)` makes a module per store (`sqlite::a`, `redis::b`, …) whose
/// tests call `a(Backend::Sqlite)`, and so on; `all` names every store a
/// daemon runs on, `network` the same without SQLite (partitions cut
/// network stores). `long [mysql, …]` adds modules whose tests are in the
/// long tier only (`#[ignore]`, run by `.ci/long`): what the default tier
/// keeps on a few stores, the long tier runs on every one.
#[macro_export]
macro_rules! per_store {
    (all $($rest:tt)*) => {
        $crate::per_store!([sqlite, mysql, postgres, redis, sentinel, redlock, zookeeper, etcd] $($rest)*);
    };
    (network $($rest:tt)*) => {
        $crate::per_store!([mysql, postgres, redis, sentinel, redlock, zookeeper, etcd] $($rest)*);
    };
    ([$($store:ident),* $(,)?] long [$($long:ident),* $(,)?]; $($scenario:ident),+ $(,)?) => {
        $crate::per_store!(@default [$($store),*]; $($scenario),+);
        $crate::per_store!(@long [$($long),*]; $($scenario),+);
    };
    ([$($store:ident),* $(,)?]; $($scenario:ident),+ $(,)?) => {
        $crate::per_store!(@default [$($store),*]; $($scenario),+);
    };
    (@default []; $($scenario:ident),+) => {};
    (@default [$store:ident $(, $more:ident)*]; $($scenario:ident),+) => {
        mod $store {
            $(
                #[test]
                fn $scenario() {
                    super::$scenario($crate::support::Backend::named(stringify!($store)))
                }
            )+
        }
        $crate::per_store!(@default [$($more),*]; $($scenario),+);
    };
    (@long []; $($scenario:ident),+) => {};
    (@long [$store:ident $(, $more:ident)*]; $($scenario:ident),+) => {
        mod $store {
            $(
                #[test]
                #[ignore = "long tier (.ci/long)"]
                fn $scenario() {
                    super::$scenario($crate::support::Backend::named(stringify!($store)))
                }
            )+
        }
        $crate::per_store!(@long [$($more),*]; $($scenario),+);
    };
}
