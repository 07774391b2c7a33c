//! Redis call counts from INFO commandstats: script calls per phase ([`ScriptCalls`]), and the
//! readers [`script_calls`] and [`command_calls`] (public; tests under `tests/` use them).

/// Counts Redis script calls over one phase, from INFO commandstats (a count, not a timing).
pub(super) struct ScriptCalls {
    conn: Option<redis::aio::MultiplexedConnection>,
    before: u64,
}

impl ScriptCalls {
    pub(super) async fn start(
        conn: Option<redis::aio::MultiplexedConnection>,
    ) -> anyhow::Result<Self> {
        let before = match &conn {
            Some(c) => script_calls(&mut c.clone()).await?,
            None => 0,
        };
        Ok(Self { conn, before })
    }

    pub(super) async fn per(self, cycles: u64) -> anyhow::Result<Option<f64>> {
        let Some(mut conn) = self.conn else {
            return Ok(None);
        };
        let after = script_calls(&mut conn).await?;
        Ok((cycles > 0).then(|| (after - self.before) as f64 / cycles as f64))
    }
}

/// EVALSHA + EVAL calls Redis has served (scripts' inner commands are counted apart by Redis).
pub async fn script_calls(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    Ok(["evalsha", "eval"]
        .iter()
        .map(|name| command_calls(&info, name))
        .sum())
}

/// `calls=` of `cmdstat_<name>` in an INFO commandstats reply.
pub fn command_calls(info: &str, name: &str) -> u64 {
    let prefix = format!("cmdstat_{name}:");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').find_map(|f| f.strip_prefix("calls=")))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_calls_are_read_by_exact_command_name() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=12,usec=3,usec_per_call=0.25,rejected_calls=0,failed_calls=0\r\ncmdstat_eval:calls=2,usec=1\r\n";
        assert_eq!(command_calls(info, "evalsha"), 12);
        assert_eq!(command_calls(info, "eval"), 2);
        assert_eq!(command_calls(info, "get"), 0);
    }
}
