package main

import (
	"net"
	"syscall"
)

// quickAck returns conn so that the data each of its reads returns is
// acknowledged at once, when conn is a TCP connection; conn itself
// otherwise.
//
// Why: an upstream that writes an answer's header and its body in two
// sends, without TCP_NODELAY (Python's http.server, and many small
// services), has Nagle's algorithm hold the body until the header is
// acknowledged. On a kept-alive connection the proxy's kernel is in its
// interactive ("pingpong") mode, entered anew with every request sent, and
// delays that acknowledgement by up to 40 ms, waiting for data to carry it
// that never comes: each new operation then took 40 ms more. TCP_QUICKACK
// leaves that mode and sends the acknowledgement due; it is not sticky (the
// next request sent enters the mode again), so it is set after every read
// that returned data, at the cost of one setsockopt.
func quickAck(conn net.Conn) net.Conn {
	tc, ok := conn.(*net.TCPConn)
	if !ok {
		return conn
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return conn
	}
	// Only net.Conn's methods are promoted, not *net.TCPConn's WriteTo:
	// every read goes through Read.
	return &quickAckConn{Conn: conn, raw: raw}
}

type quickAckConn struct {
	net.Conn
	raw syscall.RawConn
}

func (c *quickAckConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		// An error (the connection closed meanwhile) only means the
		// acknowledgement waits as it would have.
		_ = c.raw.Control(setQuickAck)
	}
	return n, err
}

func setQuickAck(fd uintptr) {
	_ = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_QUICKACK, 1)
}
