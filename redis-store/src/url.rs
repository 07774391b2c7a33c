//! Redis URLs: which topology a URL names, and the parts of the multi-host forms
//! (`redis+sentinel://`, `redis+cluster://`) that the `redis` crate's own URL parser does not
//! read; and [`RedisUrl`], a URL parsed once and kept as the secret it may be.

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo};

use lockbroker_core::store::StoreError;

/// Which Redis deployment a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// `redis://`, `rediss://`: one server.
    Single,
    /// `redis+sentinel://`: the master that the sentinels name.
    Sentinel,
    /// `redis+cluster://`: a Redis Cluster.
    Cluster,
}

/// A parsed Redis URL, of any topology.
#[derive(Clone)]
pub struct ParsedUrl {
    pub topology: Topology,
    pub tls: bool,
    /// The hosts given: the server (single), the sentinels, or the cluster's seed nodes.
    pub hosts: Vec<(String, u16)>,
    pub username: Option<String>,
    pub password: Option<String>,
    /// Sentinel only: the master's name.
    pub master_name: Option<String>,
    pub db: i64,
    /// Single only: the URL as the `redis` crate reads it (query options included).
    single: Option<ConnectionInfo>,
}

fn invalid(why: impl std::fmt::Display) -> StoreError {
    StoreError::Failed(format!("invalid Redis URL: {why}"))
}

impl ParsedUrl {
    /// Parses `url`. Error messages never repeat the URL (it may carry a password).
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| invalid("no scheme (redis://, rediss://, redis+sentinel://, …)"))?;
        let (topology, tls) = match scheme.to_ascii_lowercase().as_str() {
            "redis" => (Topology::Single, false),
            "rediss" => (Topology::Single, true),
            "redis+sentinel" => (Topology::Sentinel, false),
            "rediss+sentinel" => (Topology::Sentinel, true),
            "redis+cluster" => (Topology::Cluster, false),
            "rediss+cluster" => (Topology::Cluster, true),
            other => return Err(invalid(format_args!("unknown scheme {other}://"))),
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hostlist) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let (username, password) = match userinfo {
            None => (None, None),
            Some(userinfo) => {
                let (user, pass) = match userinfo.split_once(':') {
                    Some((user, pass)) => (user, Some(pass)),
                    None => (userinfo, None),
                };
                let decode = |s: &str| {
                    percent_decode(s).ok_or_else(|| invalid("bad %-escape in the user or password"))
                };
                (
                    (!user.is_empty()).then(|| decode(user)).transpose()?,
                    pass.map(decode).transpose()?,
                )
            }
        };
        let hosts = hostlist
            .split(',')
            .map(parse_host)
            .collect::<Result<Vec<_>, _>>()?;
        let single = if topology == Topology::Single {
            Some(
                url.into_connection_info()
                    .map_err(|e| invalid(e.to_string()))?,
            )
        } else {
            None
        };
        if topology == Topology::Single && hosts.len() != 1 {
            return Err(invalid(
                "one host only for redis:// (use redis+sentinel:// or redis+cluster:// for more)",
            ));
        }
        let path = if topology == Topology::Single {
            ""
        } else {
            path
        };
        let mut segments = path.split('/').filter(|s| !s.is_empty());
        let master_name = if topology == Topology::Sentinel {
            Some(
                segments
                    .next()
                    .ok_or_else(|| invalid("redis+sentinel:// needs the master's name: …/MASTER"))?
                    .to_owned(),
            )
        } else {
            None
        };
        let db = match segments.next() {
            None => 0,
            Some(db) => db
                .parse::<i64>()
                .ok()
                .filter(|db| *db >= 0)
                .ok_or_else(|| invalid(format_args!("database {db:?} is not a number")))?,
        };
        if topology == Topology::Cluster && db != 0 {
            return Err(invalid("Redis Cluster has database 0 only"));
        }
        if let Some(extra) = segments.next() {
            return Err(invalid(format_args!("unexpected path segment {extra:?}")));
        }
        Ok(Self {
            topology,
            tls,
            hosts,
            username,
            password,
            master_name,
            db,
            single,
        })
    }

    /// The address of host `i`, with TLS if the URL asked for it.
    pub fn addr(&self, i: usize) -> ConnectionAddr {
        let (host, port) = self.hosts[i].clone();
        node_addr(host, port, self.tls)
    }

    /// User, password and database for the data nodes.
    pub fn redis_info(&self) -> RedisConnectionInfo {
        let mut info = RedisConnectionInfo::default().set_db(self.db);
        if let Some(user) = &self.username {
            info = info.set_username(user);
        }
        if let Some(pass) = &self.password {
            info = info.set_password(pass);
        }
        info
    }

    /// Connection info for host `i` as a data node.
    pub fn connection_info(&self, i: usize) -> Result<ConnectionInfo, StoreError> {
        if let Some(single) = &self.single {
            return Ok(single.clone());
        }
        let info = self
            .addr(i)
            .into_connection_info()
            .map_err(|e| invalid(e.to_string()))?;
        Ok(info.set_redis_settings(self.redis_info()))
    }
}

/// A Redis URL, parsed once, which may hold a password. `Debug` and `Display` mask it, and the
/// user name with it (`redis://***@host:port/db`), so neither a log line nor a printed
/// configuration shows it.
#[derive(Clone)]
pub struct RedisUrl {
    text: String,
    parsed: ParsedUrl,
}

impl RedisUrl {
    /// Parses `url` (see [`ParsedUrl::parse`]); errors never repeat it.
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        Ok(Self {
            parsed: ParsedUrl::parse(url)?,
            text: url.to_owned(),
        })
    }

    /// Its parts, password included: for connecting, never for printing.
    pub fn parsed(&self) -> &ParsedUrl {
        &self.parsed
    }

    /// The URL as configured, password included: never for printing.
    pub fn expose(&self) -> &str {
        &self.text
    }

    /// Which deployment it names.
    pub fn topology(&self) -> Topology {
        self.parsed.topology
    }

    /// Whether it asks for TLS (`rediss…://`).
    pub fn tls(&self) -> bool {
        self.parsed.tls
    }
}

impl PartialEq for RedisUrl {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for RedisUrl {}

impl std::fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let url = &self.text;
        // The last `@`: a password may contain `@` itself.
        match (url.find("://"), url.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                write!(f, "{}://***@{}", &url[..scheme], &url[at + 1..])
            }
            _ => f.write_str(url),
        }
    }
}

impl std::fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RedisUrl")
            .field(&format_args!("{self}"))
            .finish()
    }
}

/// The address of a Redis node, over TLS (with certificate and host name checks) or not.
pub(crate) fn node_addr(host: String, port: u16, tls: bool) -> ConnectionAddr {
    if tls {
        ConnectionAddr::TcpTls {
            host,
            port,
            insecure: false,
            tls_params: None,
        }
    } else {
        ConnectionAddr::Tcp(host, port)
    }
}

fn parse_host(host: &str) -> Result<(String, u16), StoreError> {
    let (name, port) = match host.rsplit_once(':') {
        // [::1]:6379
        Some((name, port)) if !name.ends_with(':') => (name, port),
        _ => (host, "6379"),
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    if name.is_empty() {
        return Err(invalid("a host is empty"));
    }
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| invalid(format_args!("port {port:?} of host {name:?} is not a port")))?;
    Ok((name.to_owned(), port))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_name_sentinels_master_and_db() {
        let url =
            ParsedUrl::parse("redis+sentinel://app:s%40cret@h1:26379,h2:26380/mymaster/2").unwrap();
        assert_eq!(url.topology, Topology::Sentinel);
        assert!(!url.tls);
        assert_eq!(
            url.hosts,
            [("h1".to_owned(), 26379), ("h2".to_owned(), 26380)]
        );
        assert_eq!(url.username.as_deref(), Some("app"));
        assert_eq!(url.password.as_deref(), Some("s@cret"));
        assert_eq!(url.master_name.as_deref(), Some("mymaster"));
        assert_eq!(url.db, 2);
    }

    #[test]
    fn cluster_urls_take_seed_nodes_over_tls() {
        let url = ParsedUrl::parse("rediss+cluster://:pw@127.0.0.1:7000,127.0.0.1:7001").unwrap();
        assert_eq!(url.topology, Topology::Cluster);
        assert!(url.tls);
        assert_eq!(url.hosts.len(), 2);
        assert_eq!(url.username, None);
        assert_eq!(url.password.as_deref(), Some("pw"));
    }

    #[test]
    fn bad_urls_are_refused_without_repeating_the_password() {
        for url in [
            "redis+sentinel://u:hunter2@h1:1",
            "redis+cluster://u:hunter2@h1:1/3",
            "redis://u:hunter2@h1:1,h2:2",
            "redis+cluster://u:hunter2@h1:notaport",
            "memcached://u:hunter2@h1:1",
        ] {
            let error = ParsedUrl::parse(url).err().expect(url).to_string();
            assert!(!error.contains("hunter2"), "{error}");
        }
    }
}
