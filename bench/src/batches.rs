//! The broker's group commit as its `/metrics` shows it (`lockbroker_store_batch_size`): how many
//! operations its batched Redis calls carried over a run, and what share of the run's operations
//! went in batches.

use anyhow::Context;
use serde::Serialize;

const FAMILY: &str = "lockbroker_store_batch_size";

/// The histogram's totals at one moment.
#[derive(Debug, Default)]
pub(super) struct BatchTotals {
    count: f64,
    sum: f64,
    /// Each bucket's upper bound and cumulative count.
    buckets: Vec<(f64, f64)>,
}

/// A run's batches: operations per batched call (mean, p50, p99, from the histogram's buckets),
/// and the share of the run's operations that went in a batch.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BatchFigures {
    pub batches: f64,
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    pub batched_share: f64,
}

impl BatchTotals {
    /// The broker's totals now.
    pub(super) async fn read(http: &reqwest::Client, base: &str) -> anyhow::Result<Self> {
        let text = http
            .get(format!("{base}/metrics"))
            .send()
            .await?
            .text()
            .await
            .context("the broker's /metrics")?;
        Ok(Self::parse(&text))
    }

    fn parse(text: &str) -> Self {
        let mut totals = Self::default();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(FAMILY) else {
                continue;
            };
            let Some((name, value)) = rest.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            if name == "_count" {
                totals.count = value;
            } else if name == "_sum" {
                totals.sum = value;
            } else if let Some(le) = name
                .strip_prefix("_bucket{le=\"")
                .and_then(|l| l.strip_suffix("\"}"))
            {
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::INFINITY)
                };
                totals.buckets.push((le, value));
            }
        }
        totals
    }

    /// The batches since `before`, over a run of `operations` store operations.
    pub(super) fn since(&self, before: &Self, operations: f64) -> BatchFigures {
        let batches = self.count - before.count;
        let batched = self.sum - before.sum;
        let quantile = |q: f64| {
            let goal = q * batches;
            self.buckets
                .iter()
                .zip(&before.buckets)
                .find(|((_, now), (_, then))| now - then >= goal)
                .map_or(0.0, |((le, _), _)| *le)
        };
        BatchFigures {
            batches,
            mean: if batches > 0.0 {
                batched / batches
            } else {
                0.0
            },
            p50: if batches > 0.0 { quantile(0.5) } else { 0.0 },
            p99: if batches > 0.0 { quantile(0.99) } else { 0.0 },
            batched_share: if operations > 0.0 {
                batched / operations
            } else {
                0.0
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_figures_come_from_the_histograms_difference() {
        let before = BatchTotals::parse(
            "lockbroker_store_batch_size_sum 10\nlockbroker_store_batch_size_count 5\n\
             lockbroker_store_batch_size_bucket{le=\"1.0\"} 0\n\
             lockbroker_store_batch_size_bucket{le=\"2.0\"} 5\n\
             lockbroker_store_batch_size_bucket{le=\"4.0\"} 5\n\
             lockbroker_store_batch_size_bucket{le=\"+Inf\"} 5\n",
        );
        let after = BatchTotals::parse(
            "lockbroker_store_batch_size_sum 50\nlockbroker_store_batch_size_count 15\n\
             lockbroker_store_batch_size_bucket{le=\"1.0\"} 0\n\
             lockbroker_store_batch_size_bucket{le=\"2.0\"} 6\n\
             lockbroker_store_batch_size_bucket{le=\"4.0\"} 15\n\
             lockbroker_store_batch_size_bucket{le=\"+Inf\"} 15\n",
        );
        let figures = after.since(&before, 80.0);
        assert_eq!(figures.batches, 10.0);
        assert_eq!(figures.mean, 4.0);
        assert_eq!(figures.p50, 4.0);
        assert_eq!(figures.p99, 4.0);
        assert_eq!(figures.batched_share, 0.5);
    }
}
