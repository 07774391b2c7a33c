//! The byte stream under hyper: [`Stream`] hands back the bytes read ahead to tell HTTP/2 from
//! HTTP/1.1, and on HTTP/1.1 gives hyper's own rejections the API's JSON error body.
//!
//! Hyper answers a request it cannot parse (a malformed request line or header field, a control
//! character in the target, an invalid `Content-Length`, a head over the size limit or with too
//! many fields) by itself, before any service runs, with an empty body, and closes the
//! connection; it offers no hook to shape that answer. What it writes is recognisable: a head
//! alone, status 4xx or 5xx, `content-length: 0` and no `content-type`. Every error the router
//! sends has a JSON body and a `content-type`, so a head of that shape at the start of a write is
//! one of hyper's, and [`Stream`] writes the same status with the JSON body in its place.
//!
//! On HTTP/1.1 it also closes *lingeringly*: after its last answer (a `413` sent before the body
//! was read, say) it sends FIN, then reads and drops what the client still sends, for a moment,
//! before closing. Closing a socket with unread data sends a reset, which can make the client
//! lose the answer it was sent just before.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use crate::http::error::framework_rejection;

/// A connection's byte stream, as hyper reads and writes it.
pub(crate) struct Stream<I> {
    inner: I,
    /// Bytes read before hyper took over (to tell the protocol), returned first.
    replay: Vec<u8>,
    replayed: usize,
    /// Whether hyper's automatic rejections are rewritten (HTTP/1.1 only).
    rewrite: bool,
    /// A rewritten rejection not yet fully written.
    pending: Vec<u8>,
    written: usize,
    /// Whether the write side is shut down (FIN sent).
    shut: bool,
    /// After the FIN: until when what the client still sends is read and dropped.
    linger: Option<Pin<Box<Sleep>>>,
    lingered: usize,
}

/// How long, and how many bytes at most, a closing HTTP/1.1 connection reads and drops what the
/// client still sends (the rest of a body refused before it was read): enough for any body
/// under way on a sane network, short enough that a client cannot hold its connection with it.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 256 * 1024;

impl<I> Stream<I> {
    pub(crate) fn new(inner: I, replay: Vec<u8>, rewrite: bool) -> Self {
        Self {
            inner,
            replay,
            replayed: 0,
            rewrite,
            pending: Vec::new(),
            written: 0,
            shut: false,
            linger: None,
            lingered: 0,
        }
    }
}

impl<I: AsyncWrite + Unpin> Stream<I> {
    /// Writes what is left of a rewritten rejection.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n =
                ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }

    /// If `buf` starts with one of hyper's automatic rejections, queues the JSON one instead and
    /// returns how many bytes of `buf` it stands for.
    fn take_rejection(&mut self, buf: &[u8]) -> Option<usize> {
        if !self.rewrite {
            return None;
        }
        let (consumed, replacement) = rewrite_rejection(buf)?;
        self.pending = replacement;
        self.written = 0;
        Some(consumed)
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Stream<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.replayed < this.replay.len() {
            let rest = &this.replay[this.replayed..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.replayed += n;
            if this.replayed == this.replay.len() {
                this.replay = Vec::new();
                this.replayed = 0;
                // What else has arrived goes in the same read: hyper then holds the whole head
                // after its first read. Handed only the replayed bytes, it would read the rest
                // into space reserved past them, doubling its 8 KiB read buffer for every
                // connection. Nothing more yet (`Pending`) is still a read of `n` bytes.
                if buf.remaining() > 0
                    && let Poll::Ready(Err(e)) = Pin::new(&mut this.inner).poll_read(cx, buf)
                {
                    return Poll::Ready(Err(e));
                }
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        if let Some(consumed) = this.take_rejection(buf) {
            // Written by the next calls if the socket is full now; hyper flushes next.
            let _ = this.poll_pending(cx)?;
            return Poll::Ready(Ok(consumed));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        if let Some(first) = bufs.iter().find(|b| !b.is_empty())
            && let Some(consumed) = this.take_rejection(first)
        {
            let _ = this.poll_pending(cx)?;
            return Poll::Ready(Ok(consumed));
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        if !this.shut {
            ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            this.shut = true;
            if this.rewrite {
                this.linger = Some(Box::pin(tokio::time::sleep(LINGER)));
            }
        }
        if let Some(deadline) = this.linger.as_mut() {
            let mut buf = [0u8; 4096];
            while deadline.as_mut().poll(cx).is_pending() && this.lingered < LINGER_BYTES {
                let mut read = ReadBuf::new(&mut buf);
                match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                    Poll::Ready(Ok(())) if !read.filled().is_empty() => {
                        this.lingered += read.filled().len();
                    }
                    // The client closed too (or the connection broke): nothing left to drop.
                    Poll::Ready(_) => break,
                    Poll::Pending => return Poll::Pending,
                }
            }
            this.linger = None;
        }
        Poll::Ready(Ok(()))
    }
}

/// `Some((length of hyper's head in buf, the response to send instead))` when `buf` starts with
/// a bodiless error head that the router could not have written.
fn rewrite_rejection(buf: &[u8]) -> Option<(usize, Vec<u8>)> {
    let rest = buf
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| buf.strip_prefix(b"HTTP/1.0 "))?;
    let status: u16 = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    if !(400..600).contains(&status) {
        return None;
    }
    let head_len = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buf[..head_len]).ok()?;
    let mut lines = head.split("\r\n").filter(|l| !l.is_empty());
    let status_line = lines.next()?;
    let mut kept = Vec::new();
    let mut empty_body = false;
    for line in lines {
        let (name, value) = line.split_once(':')?;
        let name = name.trim().to_ascii_lowercase();
        match name.as_str() {
            "content-type" | "transfer-encoding" => return None,
            "content-length" => empty_body = value.trim() == "0",
            "connection" => {}
            _ => kept.push(line),
        }
    }
    if !empty_body {
        return None;
    }
    let body = framework_rejection(status);
    let mut out = Vec::with_capacity(head_len + body.len() + 64);
    out.extend_from_slice(status_line.as_bytes());
    out.extend_from_slice(b"\r\ncontent-type: application/json\r\n");
    out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    out.extend_from_slice(b"connection: close\r\n");
    for line in kept {
        out.extend_from_slice(line.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    Some((head_len, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_s_bodiless_rejection_gets_the_json_body() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Mon, 23 Nov 2026 11:00:00 GMT\r\n\r\n";
        let (consumed, out) = rewrite_rejection(head).expect("rewritten");
        assert_eq!(consumed, head.len());
        let out = String::from_utf8(out).unwrap();
        assert!(out.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(out.contains("content-type: application/json\r\n"));
        assert!(out.contains("date: Mon, 23 Nov 2026 11:00:00 GMT\r\n"));
        let body = out.split("\r\n\r\n").nth(1).unwrap();
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["error"], "request_header_fields_too_large");
        assert!(out.contains(&format!("content-length: {}\r\n", body.len())));
    }

    #[test]
    fn the_router_s_own_answers_pass_untouched() {
        for head in [
            &b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n"[..],
            b"HTTP/1.1 204 No Content\r\ndate: x\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n",
            b"{\"error\":\"x\"}",
        ] {
            assert!(rewrite_rejection(head).is_none(), "{:?}", String::from_utf8_lossy(head));
        }
    }
}
