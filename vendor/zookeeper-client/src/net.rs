//! cronlease: the TCP stream on tokio's reactor, in place of async-net's
//! (async-io's reactor thread). With async-net every reply and every timer
//! of the session crossed from async-io's thread to a tokio worker: two
//! wakes where tokio's own reactor makes one.

use std::io::{IoSlice, Result};
use std::pin::Pin;
use std::task::{Context, Poll};

/// A connected TCP stream (tokio's), read and written through the `futures`
/// traits the rest of this crate uses.
#[derive(Debug)]
pub struct TcpStream(tokio::net::TcpStream);

impl TcpStream {
    /// Connects to `host:port` (resolved as tokio resolves it), with
    /// `TCP_NODELAY` set: a request is one small write.
    pub async fn connect((host, port): (&str, u16)) -> Result<Self> {
        let stream = tokio::net::TcpStream::connect((host, port)).await?;
        stream.set_nodelay(true)?;
        Ok(Self(stream))
    }
}

impl futures::io::AsyncRead for TcpStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<Result<usize>> {
        let mut buf = tokio::io::ReadBuf::new(buf);
        match tokio::io::AsyncRead::poll_read(Pin::new(&mut self.get_mut().0), cx, &mut buf) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(buf.filled().len())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl futures::io::AsyncWrite for TcpStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<Result<usize>> {
        tokio::io::AsyncWrite::poll_write(Pin::new(&mut self.get_mut().0), cx, buf)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<Result<usize>> {
        tokio::io::AsyncWrite::poll_write_vectored(Pin::new(&mut self.get_mut().0), cx, bufs)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        tokio::io::AsyncWrite::poll_flush(Pin::new(&mut self.get_mut().0), cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        tokio::io::AsyncWrite::poll_shutdown(Pin::new(&mut self.get_mut().0), cx)
    }
}
