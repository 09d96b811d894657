//! Buffers kept for reuse per thread: read buffers, a few per thread (every worker response is
//! read into a buffer of [`READ_SIZE`] bytes, and allocating one per response took the
//! allocator's slow path for large blocks each time), and one of each list every response
//! builds ([`Kept`]: a response head's header lines, a worker response's header offsets, a
//! client connection's writes).
//!
//! They are also what keeps an idle client cheap: a client connection borrows a read
//! buffer only while bytes are arriving and a write buffer only while a response goes out, so
//! one that waits holds neither (docs/hardening.md, "Memory per connection").

use bytes::BytesMut;
use std::cell::{Cell, RefCell};
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

/// The size of a read buffer, and of each read into it.
pub const READ_SIZE: usize = 16 * 1024;

/// Buffers kept per thread: enough for the responses a thread finishes between two it starts,
/// at most 8 x 16 KiB of memory per thread.
const KEPT: usize = 8;

/// The most bytes a kept list may hold: a larger one (from an unusual head) goes back to the
/// allocator.
const KEPT_BYTES: usize = 4096;

/// The most bytes a kept write buffer may hold: a response head and a body copied behind it
/// (bodies up to 16 KiB are; larger ones are sent from where they are).
const KEPT_WRITE_BYTES: usize = 24 * 1024;

/// The least room a read may be given: less, and the buffer is replaced or grown first.
const MIN_ROOM: usize = READ_SIZE / 4;

/// What a waiting client's unfinished head (or chunk line) may keep beyond its own bytes when
/// its read buffer goes back: more than this and the bytes move to a buffer of their size.
const WAIT_SLACK: usize = 512;

thread_local! {
    static SPARE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
    static LINES: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
    static SPANS: Cell<Vec<[u32; 4]>> = const { Cell::new(Vec::new()) };
    static WRITES: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
}

/// A list taken from its thread's one spare, which goes back empty, on drop, to the spare of the
/// thread that drops it (a request's task may have moved to another thread meanwhile). Every
/// response builds a few such lists, and an allocation fewer per request is worth a
/// thread-local.
#[derive(Debug)]
pub struct Kept<T: 'static> {
    list: Vec<T>,
    home: &'static LocalKey<Cell<Vec<T>>>,
    /// The most bytes the list may hold and still be kept.
    limit: usize,
}

/// A response head's header lines.
pub type HeadLines = Kept<u8>;

/// A parsed head's header offsets (name start and end, value start and end).
pub type HeaderSpans = Kept<[u32; 4]>;

/// The bytes a client connection gathers for one send ([`take_write_buffer`]): the same type
/// as [`HeadLines`], kept apart from them with a larger limit.
pub type WriteBuffer = Kept<u8>;

/// An empty buffer for a client connection's next send: its thread's spare when there is one.
pub fn take_write_buffer() -> WriteBuffer {
    Kept::take_from(&WRITES, 1024, KEPT_WRITE_BYTES)
}

impl HeadLines {
    /// An empty buffer with room for a usual head.
    pub fn take() -> Self {
        Kept::take_from(&LINES, 256, KEPT_BYTES)
    }
}

impl HeaderSpans {
    /// An empty list with room for a usual head's headers.
    pub fn take() -> Self {
        Kept::take_from(&SPANS, 16, KEPT_BYTES)
    }
}

impl<T: 'static> Kept<T> {
    fn take_from(home: &'static LocalKey<Cell<Vec<T>>>, room: usize, limit: usize) -> Self {
        let mut list = home.with(Cell::take);
        if list.capacity() == 0 {
            list.reserve(room);
        }
        Self { list, home, limit }
    }
}

impl<T> Deref for Kept<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.list
    }
}

impl<T> DerefMut for Kept<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.list
    }
}

impl<T> Drop for Kept<T> {
    fn drop(&mut self) {
        let mut list = std::mem::take(&mut self.list);
        if list.capacity() * std::mem::size_of::<T>() <= self.limit {
            list.clear();
            // Not kept when the thread's locals are already gone (a drop at thread exit).
            let _ = self.home.try_with(|h| h.set(list));
        }
    }
}

/// A read buffer that, dropped when nothing else shares its memory any more, goes back to the
/// spares of the thread that drops it instead of the allocator.
#[derive(Debug)]
pub struct ReadBuffer(BytesMut);

impl ReadBuffer {
    /// An empty buffer with room for a read: a spare one when the thread has one.
    pub fn take() -> Self {
        Self(spare())
    }

    /// No buffer at all (nothing allocated): what a waiting client connection holds.
    pub fn none() -> Self {
        Self(BytesMut::new())
    }

    /// Makes room for a read: a spare buffer when this one is empty or holds only a few bytes
    /// (an unfinished head moved aside by [`Self::wait`]), else room for [`READ_SIZE`] more.
    pub fn ready(&mut self) {
        if self.0.capacity() - self.0.len() >= MIN_ROOM {
            return;
        }
        if self.0.len() <= READ_SIZE / 2 {
            let mut b = spare();
            b.extend_from_slice(&self.0);
            give_back(std::mem::replace(&mut self.0, b));
        } else {
            self.0.reserve(READ_SIZE);
        }
    }

    /// For a connection about to wait for more bytes: gives the buffer back to the thread's
    /// spares, keeping only the bytes it holds (in a buffer of their size when they are few).
    pub fn wait(&mut self) {
        if self.0.is_empty() {
            give_back(std::mem::take(&mut self.0));
        } else if self.0.capacity() > self.0.len() + WAIT_SLACK {
            let own = BytesMut::from(&self.0[..]);
            give_back(std::mem::replace(&mut self.0, own));
        }
    }
}

/// A spare read buffer of this thread's, or a new one.
fn spare() -> BytesMut {
    SPARE.with(|s| s.borrow_mut().pop()).unwrap_or_else(|| BytesMut::with_capacity(READ_SIZE))
}

/// Keeps `buf` as one of this thread's spares when nothing else shares its memory any more and
/// the thread has room; otherwise it goes back to the allocator.
fn give_back(mut buf: BytesMut) {
    buf.clear();
    // Only a buffer whose memory no `Bytes` split from it still holds, and as large as a
    // fresh one, is kept.
    if buf.try_reclaim(READ_SIZE) {
        // Not kept when the thread's locals are already gone (a drop at thread exit).
        let _ = SPARE.try_with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < KEPT {
                s.push(buf);
            }
        });
    }
}

impl Deref for ReadBuffer {
    type Target = BytesMut;
    fn deref(&self) -> &BytesMut {
        &self.0
    }
}

impl DerefMut for ReadBuffer {
    fn deref_mut(&mut self) -> &mut BytesMut {
        &mut self.0
    }
}

impl Drop for ReadBuffer {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_comes_back_only_when_nothing_shares_it() {
        let mut a = ReadBuffer::take();
        a.extend_from_slice(b"head");
        let ptr = a.as_ptr();
        let held = a.split_to(2).freeze();
        drop(a);
        // Still shared by `held`: not kept, so the next one is another allocation.
        let b = ReadBuffer::take();
        assert_ne!(b.as_ptr(), ptr);
        assert_eq!(&held[..], b"he");
        drop(held);
        let mut c = ReadBuffer::take();
        c.extend_from_slice(b"xy");
        let ptr = c.as_ptr();
        drop(c);
        let d = ReadBuffer::take();
        assert_eq!(d.as_ptr(), ptr, "an unshared buffer is reused");
        assert!(d.is_empty() && d.capacity() >= READ_SIZE);
    }

    #[test]
    fn head_lines_come_back_empty_unless_too_large() {
        let mut a = HeadLines::take();
        a.extend_from_slice(b"x-a: 1\r\n");
        let ptr = a.as_ptr();
        drop(a);
        let b = HeadLines::take();
        assert_eq!((b.as_ptr(), b.len()), (ptr, 0), "reused, and empty");
        let mut big = b;
        big.reserve(2 * KEPT_BYTES);
        drop(big);
        assert!(HeadLines::take().capacity() < KEPT_BYTES, "a large one is not kept");
        let mut spans = HeaderSpans::take();
        spans.push([1, 2, 3, 4]);
        let ptr = spans.as_ptr();
        drop(spans);
        let again = HeaderSpans::take();
        assert_eq!((again.as_ptr(), again.len()), (ptr, 0), "each kind has its own spare");
    }

    #[test]
    fn a_waiting_buffer_goes_back_and_keeps_only_its_bytes() {
        let mut a = ReadBuffer::none();
        assert_eq!(a.capacity(), 0);
        a.ready();
        assert!(a.capacity() >= READ_SIZE);
        a.wait();
        assert_eq!(a.capacity(), 0, "an empty buffer goes back while the connection waits");
        a.ready();
        a.extend_from_slice(b"POST / HTTP/1.1\r\nHost: x\r\n");
        a.wait();
        assert_eq!(&a[..], b"POST / HTTP/1.1\r\nHost: x\r\n");
        assert!(a.capacity() < 64, "an unfinished head keeps its bytes alone: {}", a.capacity());
        a.ready();
        assert!(a.capacity() >= READ_SIZE);
        assert_eq!(&a[..], b"POST / HTTP/1.1\r\nHost: x\r\n", "and gets them back in a full buffer");
        let ptr = a.as_ptr();
        a.ready();
        assert_eq!(a.as_ptr(), ptr, "a buffer with room is kept as it is");
    }

    #[test]
    fn at_most_a_few_are_kept() {
        let all: Vec<ReadBuffer> = (0..KEPT + 4).map(|_| ReadBuffer::take()).collect();
        drop(all);
        assert_eq!(SPARE.with(|s| s.borrow().len()), KEPT);
    }
}
