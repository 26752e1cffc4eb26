//! The protected resource: a register per lock in a Redis of its own (faults never
//! touch it), written with a read-modify-write that only stays right under mutual
//! exclusion, and fenced as a real resource would be: a token lower than the highest
//! it has seen is refused and counted.

use fred::prelude::*;

/// A register script: the fence check first (a token in `ARGV[1]` lower than the
/// highest seen is refused, counted in `refused`, and answered `$refused`), then `$body`.
macro_rules! fenced {
    ($refused:literal, $body:literal) => {
        concat!(
            "local top = tonumber(redis.call('hget', KEYS[1], 'token') or '0')\n",
            "if tonumber(ARGV[1]) < top then\n",
            "  redis.call('hincrby', KEYS[1], 'refused', 1)\n",
            "  return ",
            $refused,
            "\nend\n",
            $body
        )
    };
}

/// Raises the register's highest token to `ARGV[1]` and returns the count, or -1
/// (counted in `refused`) when a higher token was already seen.
const FENCED_READ: &str = fenced!(
    "-1",
    "redis.call('hset', KEYS[1], 'token', ARGV[1])
return tonumber(redis.call('hget', KEYS[1], 'count') or '0')"
);

/// Sets the count to `ARGV[2]` unless a token higher than `ARGV[1]` was seen.
const FENCED_WRITE: &str = fenced!(
    "0",
    "redis.call('hset', KEYS[1], 'token', ARGV[1], 'count', ARGV[2])
return 1"
);

/// Sets the unfenced twin to `ARGV[1]`, counting the writes.
const PLAIN_WRITE: &str = "redis.call('hset', KEYS[1], 'plain', ARGV[1])
return redis.call('hincrby', KEYS[1], 'plain_writes', 1)";

/// A reader's check: the count, or -1 when a higher token was seen (without raising
/// the highest token, so concurrent readers never fence each other out).
const FENCED_PEEK: &str = fenced!("-1", "return tonumber(redis.call('hget', KEYS[1], 'count') or '0')");

/// The state of one lock's register after a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Register {
    /// Writes accepted (each adds one).
    pub count: i64,
    /// An unfenced twin of `count`, read and written without any token check: what
    /// the resource would hold without fencing.
    pub plain: i64,
    /// How often the unfenced twin was written: a holder that wrote it got past its
    /// fenced read.
    pub plain_writes: i64,
    /// Reads and writes refused for a stale token.
    pub refused: i64,
    /// The highest token seen.
    pub token: u64,
}

/// The registers, in their own Redis.
#[derive(Debug, Clone)]
pub struct Resource {
    redis: Client,
}

impl Resource {
    /// Registers in the Redis at `url` (a test-only server nobody faults).
    pub async fn connect(url: &str) -> Resource {
        Resource {
            redis: crate::redis_client(url).await,
        }
    }

    /// Reads the count with `token`; `None` when the token is refused as stale.
    pub async fn read(&self, lock: &str, token: u64) -> Result<Option<i64>, Error> {
        let count: i64 = self.eval(FENCED_READ, lock, vec![token.to_string()]).await?;
        Ok((count >= 0).then_some(count))
    }

    /// Writes `count` with `token`; false when the token is refused as stale.
    pub async fn write(&self, lock: &str, token: u64, count: i64) -> Result<bool, Error> {
        let done: i64 = self
            .eval(FENCED_WRITE, lock, vec![token.to_string(), count.to_string()])
            .await?;
        Ok(done == 1)
    }

    /// A reader's look at the count; `None` when the token is refused as stale.
    pub async fn peek(&self, lock: &str, token: u64) -> Result<Option<i64>, Error> {
        let count: i64 = self.eval(FENCED_PEEK, lock, vec![token.to_string()]).await?;
        Ok((count >= 0).then_some(count))
    }

    /// The unfenced twin: read it.
    pub async fn plain_read(&self, lock: &str) -> Result<i64, Error> {
        let v: Option<i64> = self.redis.hget(key(lock), "plain").await?;
        Ok(v.unwrap_or(0))
    }

    /// The unfenced twin: write it, whoever writes.
    pub async fn plain_write(&self, lock: &str, value: i64) -> Result<(), Error> {
        self.eval(PLAIN_WRITE, lock, vec![value.to_string()]).await.map(drop)
    }

    /// A semaphore holder comes in: returns how many holders are in now.
    pub async fn enter(&self, lock: &str) -> Result<i64, Error> {
        self.redis.incr(format!("checker:{{{lock}}}:inside")).await
    }

    /// A semaphore holder leaves.
    pub async fn leave(&self, lock: &str) -> Result<(), Error> {
        self.redis.decr::<(), _>(format!("checker:{{{lock}}}:inside")).await
    }

    /// The register of `lock`.
    pub async fn register(&self, lock: &str) -> Result<Register, Error> {
        let fields: std::collections::HashMap<String, String> = self.redis.hgetall(key(lock)).await?;
        let num = |f: &str| fields.get(f).and_then(|v| v.parse::<i64>().ok()).unwrap_or(0);
        Ok(Register {
            count: num("count"),
            plain: num("plain"),
            plain_writes: num("plain_writes"),
            refused: num("refused"),
            token: fields.get("token").and_then(|v| v.parse().ok()).unwrap_or(0),
        })
    }

    async fn eval(&self, script: &str, lock: &str, args: Vec<String>) -> Result<i64, Error> {
        self.redis.eval(script, vec![key(lock)], args).await
    }
}

fn key(lock: &str) -> String {
    format!("checker:{{{lock}}}:register")
}
