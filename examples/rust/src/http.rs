//! Just enough HTTP/1.1 over `std::net` for the gateway, the fake engine and their test: one
//! request per connection (`connection: close`), bodies by `content-length`, and response
//! bodies read by `content-length`, `transfer-encoding: chunked` (how engines such as vLLM
//! stream) or up to the connection's end.

use std::io::{self, BufRead, Read, Write};

/// The largest request body taken (a prompt of a few million token ids).
pub const MAX_BODY: usize = 64 << 20;

/// A request: method, path (without the query), headers with lower-case names, body.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The first header named `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

/// The first of `headers` named `name` (lower case).
pub fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// One line without its CRLF; an error at the end of the stream.
fn read_line(r: &mut impl BufRead) -> io::Result<String> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let trimmed = line.trim_end_matches(['\r', '\n']).len();
    line.truncate(trimmed);
    Ok(line)
}

/// Header lines up to the blank line, names in lower case.
fn read_headers(r: &mut impl BufRead) -> io::Result<Vec<(String, String)>> {
    let mut headers = Vec::new();
    loop {
        let line = read_line(r)?;
        if line.is_empty() {
            return Ok(headers);
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| invalid(format!("bad header line {line:?}")))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
}

/// Reads one request. `Ok(None)`: the connection closed before a request line.
pub fn read_request(r: &mut impl BufRead) -> io::Result<Option<Request>> {
    let line = match read_line(r) {
        Ok(line) => line,
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(_version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(invalid(format!("bad request line {line:?}")));
    };
    let headers = read_headers(r)?;
    if header(&headers, "transfer-encoding").is_some() {
        return Err(invalid("chunked request bodies are not supported"));
    }
    let length: usize = match header(&headers, "content-length") {
        Some(v) => v.parse().map_err(|_| invalid("bad content-length"))?,
        None => 0,
    };
    if length > MAX_BODY {
        return Err(invalid("body too large"));
    }
    let mut body = vec![0; length];
    r.read_exact(&mut body)?;
    let path = target.split('?').next().unwrap_or(target).to_string();
    Ok(Some(Request {
        method: method.to_string(),
        path,
        headers,
        body,
    }))
}

/// The reason phrase of the statuses used here.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Payload Too Large",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// A status line and headers, then the blank line.
pub fn write_head(w: &mut impl Write, status: u16, headers: &[(&str, &str)]) -> io::Result<()> {
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    w.write_all(head.as_bytes())
}

/// A whole response with a body, then `connection: close`.
pub fn write_response(
    w: &mut impl Write,
    status: u16,
    content_type: &str,
    extra: &[(&str, &str)],
    body: &[u8],
) -> io::Result<()> {
    let length = body.len().to_string();
    let mut headers = vec![
        ("content-type", content_type),
        ("content-length", length.as_str()),
        ("connection", "close"),
    ];
    headers.extend_from_slice(extra);
    write_head(w, status, &headers)?;
    w.write_all(body)?;
    w.flush()
}

/// An error response: `{"error": {"message": ...}}`.
pub fn write_error(w: &mut impl Write, status: u16, message: &str) -> io::Result<()> {
    let body = serde_json::json!({ "error": { "message": message } }).to_string();
    write_response(w, status, "application/json", &[], body.as_bytes())
}

/// One chunk of a `transfer-encoding: chunked` body (`data` not empty).
pub fn write_chunk(w: &mut impl Write, data: &[u8]) -> io::Result<()> {
    w.write_all(format!("{:x}\r\n", data.len()).as_bytes())?;
    w.write_all(data)?;
    w.write_all(b"\r\n")?;
    w.flush()
}

/// The last chunk of a chunked body.
pub fn write_last_chunk(w: &mut impl Write) -> io::Result<()> {
    w.write_all(b"0\r\n\r\n")?;
    w.flush()
}

/// Reads a response's status line and headers.
pub fn read_response_head(r: &mut impl BufRead) -> io::Result<(u16, Vec<(String, String)>)> {
    let line = read_line(r)?;
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| invalid(format!("bad status line {line:?}")))?;
    Ok((status, read_headers(r)?))
}

enum Framing {
    /// Bytes left in the current chunk; `None` before a chunk-size line.
    Chunked(Option<usize>),
    Length(usize),
    UntilClose,
    Done,
}

/// A response body, read as its headers say it is framed.
pub struct Body<R> {
    inner: R,
    framing: Framing,
}

impl<R: BufRead> Body<R> {
    pub fn new(inner: R, headers: &[(String, String)]) -> Body<R> {
        let framing = if header(headers, "transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
        {
            Framing::Chunked(None)
        } else if let Some(n) = header(headers, "content-length").and_then(|v| v.parse().ok()) {
            Framing::Length(n)
        } else {
            Framing::UntilClose
        };
        Body { inner, framing }
    }
}

impl<R: BufRead> Read for Body<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let available = self.fill_buf()?;
        let n = available.len().min(buf.len());
        buf[..n].copy_from_slice(&available[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl<R: BufRead> BufRead for Body<R> {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        loop {
            match self.framing {
                Framing::Done => return Ok(&[]),
                Framing::UntilClose => return self.inner.fill_buf(),
                Framing::Length(0) => {
                    self.framing = Framing::Done;
                }
                Framing::Length(n) => {
                    let available = self.inner.fill_buf()?;
                    if available.is_empty() {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    let n = n.min(available.len());
                    return Ok(&self.inner.fill_buf()?[..n]);
                }
                Framing::Chunked(None) => {
                    let line = read_line(&mut self.inner)?;
                    let size = line.split(';').next().unwrap_or("").trim();
                    let size = usize::from_str_radix(size, 16)
                        .map_err(|_| invalid(format!("bad chunk size {line:?}")))?;
                    if size == 0 {
                        read_headers(&mut self.inner)?; // trailers, then the blank line
                        self.framing = Framing::Done;
                    } else {
                        self.framing = Framing::Chunked(Some(size));
                    }
                }
                Framing::Chunked(Some(0)) => {
                    read_line(&mut self.inner)?; // the CRLF after a chunk
                    self.framing = Framing::Chunked(None);
                }
                Framing::Chunked(Some(n)) => {
                    let available = self.inner.fill_buf()?;
                    if available.is_empty() {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    let n = n.min(available.len());
                    return Ok(&self.inner.fill_buf()?[..n]);
                }
            }
        }
    }

    fn consume(&mut self, amount: usize) {
        match &mut self.framing {
            Framing::Length(n) | Framing::Chunked(Some(n)) => *n -= amount,
            _ => {}
        }
        self.inner.consume(amount);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufReader, Cursor};

    fn body(headers: &str, bytes: &str) -> String {
        let mut r = BufReader::new(Cursor::new(format!(
            "HTTP/1.1 200 OK\r\n{headers}\r\n{bytes}"
        )));
        let (status, headers) = read_response_head(&mut r).unwrap();
        assert_eq!(status, 200);
        let mut out = String::new();
        Body::new(r, &headers).read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn bodies_are_read_by_their_framing() {
        let chunked = "transfer-encoding: chunked\r\n";
        assert_eq!(
            body(chunked, "5\r\nhello\r\n7;x=y\r\n, world\r\n0\r\n\r\nNEXT"),
            "hello, world"
        );
        assert_eq!(body("content-length: 3\r\n", "abcdef"), "abc");
        assert_eq!(body("", "to the end"), "to the end");
    }

    #[test]
    fn requests_are_parsed() {
        let raw = "POST /v1/completions?x=1 HTTP/1.1\r\nContent-Length: 2\r\nX-A: b\r\n\r\n{}";
        let req = read_request(&mut BufReader::new(Cursor::new(raw)))
            .unwrap()
            .unwrap();
        assert_eq!(
            (req.method.as_str(), req.path.as_str()),
            ("POST", "/v1/completions")
        );
        assert_eq!(
            (req.header("x-a"), req.body.as_slice()),
            (Some("b"), &b"{}"[..])
        );
        assert!(read_request(&mut BufReader::new(Cursor::new("")))
            .unwrap()
            .is_none());
    }
}
