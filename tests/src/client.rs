//! `redis_client`: a connected fred client for a test's own commands against the Redis
//! under test (standalone, cluster or sentinel URL).

use fred::prelude::*;
use fred::types::RespVersion;
use std::time::Duration;

/// Bound on every command a test client sends, so a dead Redis fails a test instead of
/// hanging it.
pub const TEST_COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// Bound on connecting (and reconnecting) to a node.
pub const TEST_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Delay between reconnection attempts, in milliseconds.
const RECONNECT_DELAY_MS: u32 = 100;

/// Connects a RESP3 fred client to `url` (`redis://`, `redis-cluster://…?node=…` or
/// `redis-sentinel://…?sentinelServiceName=…`) with a reconnect policy and a command
/// timeout, and waits until it is connected; panics with the URL on failure.
pub async fn redis_client(url: &str) -> Client {
    let client = redis_client_unconnected(url);
    client
        .init()
        .await
        .unwrap_or_else(|err| panic!("connect a fred client to {url}: {err}"));
    client
}

/// Builds the same client as [`redis_client`] without connecting it, e.g. to connect a
/// clone with `clone_new()` later or to call `init()` yourself.
pub fn redis_client_unconnected(url: &str) -> Client {
    let mut config = Config::from_url(url).unwrap_or_else(|err| panic!("parse Redis URL {url}: {err}"));
    config.version = RespVersion::RESP3;
    Builder::from_config(config)
        .set_policy(ReconnectPolicy::new_constant(0, RECONNECT_DELAY_MS))
        .with_performance_config(|perf| perf.default_command_timeout = TEST_COMMAND_TIMEOUT)
        .with_connection_config(|conn| {
            conn.connection_timeout = TEST_CONNECT_TIMEOUT;
            conn.internal_command_timeout = TEST_CONNECT_TIMEOUT;
        })
        .build()
        .unwrap_or_else(|err| panic!("build a fred client for {url}: {err}"))
}
