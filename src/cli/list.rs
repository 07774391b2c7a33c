//! `lockbroker list`: the held locks or semaphores whose key starts with a prefix, page after
//! page (following the broker's cursor), as a table or as JSON lines; and the tables that
//! `status` prints too.

use std::process::ExitCode;

use clap::Args;
use lockbroker_client::{Error, LockEntry, MAX_PAGE, Page, SemaphoreEntry};
use serde::Serialize;

use super::{BrokerArgs, closed_stdout_ends_with, fail, format_ms, parse_prefix, print_json};

/// `lockbroker list` flags.
#[derive(Debug, Clone, Args)]
#[command(after_help = "Exit codes:
  0    done (also when nothing is held)
  1    error: broker unreachable, request refused (400, 403), 5xx, unexpected answer
  2    usage error (bad flag, prefix or number)")]
pub(crate) struct ListArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Only keys that start with this [default: every key].
    #[arg(value_parser = parse_prefix, default_value = "", hide_default_value = true)]
    pub prefix: String,
    /// List semaphores (with their limit and how many permits are held) instead of locks.
    #[arg(long)]
    pub semaphores: bool,
    /// Print at most this many [default: all of them, page after page].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub limit: Option<u64>,
    /// How many to ask the broker for in one request, 1 to 1000.
    #[arg(
        long,
        default_value_t = 100,
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_PAGE))
    )]
    pub page_size: u32,
    /// Print one JSON object per line (as the API lists them) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `lockbroker list`: every held lock (or semaphore) under the prefix, following the broker's
/// cursor from page to page until the last one or `--limit`.
pub(crate) async fn list(args: ListArgs) -> ExitCode {
    // A reader that stops reading (`| head -1`) took what it wanted: 0, table or JSON lines.
    closed_stdout_ends_with(0);
    let client = match args.broker.client() {
        Ok(client) => client,
        Err(code) => return code,
    };
    let (client, prefix) = (&client, args.prefix.as_str());
    let listed = if args.semaphores {
        list_all(&args, |cursor, n| async move {
            client.list_semaphores(prefix, n, cursor.as_deref()).await
        })
        .await
        .map(|(rows, more)| print_semaphore_rows(&rows, more, &args))
    } else {
        list_all(&args, |cursor, n| async move {
            client.list_locks(prefix, n, cursor.as_deref()).await
        })
        .await
        .map(|(rows, more)| print_lock_rows(&rows, more, &args))
    };
    match listed {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let what = if args.semaphores {
                "semaphores"
            } else {
                "locks"
            };
            fail(&format!("cannot list the {what}"), &e, args.json)
        }
    }
}

/// Fetches pages with `fetch(cursor, page size)` until the last one or `--limit` entries;
/// returns them and whether the broker had more than `--limit` let through. With `--json` each
/// entry is printed as its page arrives (and none is returned), so a long listing streams.
async fn list_all<T, F, Fut>(args: &ListArgs, fetch: F) -> Result<(Vec<T>, bool), Error>
where
    T: Serialize,
    F: Fn(Option<String>, u32) -> Fut,
    Fut: Future<Output = Result<Page<T>, Error>>,
{
    let mut rows = Vec::new();
    let mut cursor = None;
    let mut left = args.limit.unwrap_or(u64::MAX);
    loop {
        let ask = page_request(args.page_size, left);
        let page = fetch(cursor, ask).await?;
        let taken = page
            .items
            .len()
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        left -= taken as u64;
        let more = page.items.len() > taken || page.next_cursor.is_some();
        for row in page.items.into_iter().take(taken) {
            if args.json {
                print_json(&row);
            } else {
                rows.push(row);
            }
        }
        match page.next_cursor {
            Some(next) if left > 0 => cursor = Some(next),
            _ => return Ok((rows, more && left == 0)),
        }
    }
}

/// How many entries to ask for next: a page, or fewer when `--limit` leaves fewer to print.
fn page_request(page_size: u32, left: u64) -> u32 {
    u32::try_from(left).map_or(page_size, |left| page_size.min(left))
}

fn print_lock_rows(rows: &[LockEntry], more: bool, args: &ListArgs) {
    let rows: Vec<[String; 5]> = rows
        .iter()
        .map(|l| {
            [
                l.key.clone(),
                l.mode.to_string(),
                l.fence.to_string(),
                format_ms(l.ttl_remaining_ms),
                l.owner.clone().unwrap_or_else(|| "-".to_owned()),
            ]
        })
        .collect();
    print_listing(
        "locks",
        &rows,
        ["key", "mode", "fence", "remaining", "owner"],
        more,
        args,
    );
}

fn print_semaphore_rows(rows: &[SemaphoreEntry], more: bool, args: &ListArgs) {
    let rows: Vec<[String; 5]> = rows
        .iter()
        .map(|s| {
            [
                s.key.clone(),
                s.limit.to_string(),
                s.holders.to_string(),
                s.fence.to_string(),
                format_ms(s.ttl_remaining_ms),
            ]
        })
        .collect();
    print_listing(
        "semaphores",
        &rows,
        ["semaphore", "limit", "holders", "fence", "remaining"],
        more,
        args,
    );
}

/// The table of a listing, or a line saying nothing is held (not with `--json`, whose lines
/// are printed already), and on stderr a note when `--limit` stopped it before the end.
fn print_listing<const N: usize>(
    what: &str,
    rows: &[[String; N]],
    header: [&str; N],
    more: bool,
    args: &ListArgs,
) {
    if !args.json {
        if rows.is_empty() && args.prefix.is_empty() {
            out!("no {what} held");
        } else if rows.is_empty() {
            out!("no {what} held under {:?}", args.prefix);
        } else {
            print_table("", header, rows);
        }
    }
    if let (true, Some(limit)) = (more, args.limit) {
        eprintln!("lockbroker: --limit {limit} stopped the listing; more {what} may be held");
    }
}

/// Columns padded to their widest cell, two spaces apart; the last one is not padded.
pub(crate) fn print_table<const N: usize>(indent: &str, header: [&str; N], rows: &[[String; N]]) {
    for line in table_lines(header, rows) {
        out!("{indent}{line}");
    }
}

fn table_lines<const N: usize>(header: [&str; N], rows: &[[String; N]]) -> Vec<String> {
    let mut widths = header.map(str::len);
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; N]| {
        let mut line = String::new();
        for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == N {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<width$}  "));
            }
        }
        line
    };
    std::iter::once(line(header))
        .chain(
            rows.iter()
                .map(|row| line(row.each_ref().map(String::as_str))),
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_asks_for_no_more_than_the_limit_leaves() {
        assert_eq!(page_request(100, u64::MAX), 100);
        assert_eq!(page_request(100, 7), 7);
        assert_eq!(page_request(2, 7), 2);
    }

    #[test]
    fn tables_pad_every_column_but_the_last() {
        let rows = [
            [
                "orders:1".to_owned(),
                "shared".to_owned(),
                "worker 7".to_owned(),
            ],
            ["b".to_owned(), "exclusive".to_owned(), "-".to_owned()],
        ];
        assert_eq!(
            table_lines(["key", "mode", "owner"], &rows),
            [
                "key       mode       owner",
                "orders:1  shared     worker 7",
                "b         exclusive  -",
            ]
        );
    }
}
