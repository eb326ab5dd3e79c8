// Package faultproxy is a TCP proxy for tests that puts the faults of
// production networks between a client and a real server on loopback:
// partitions that swallow bytes without closing anything, latency, and
// connection resets, including one that lands after the server applied a
// request and before its reply got back.
//
// Every connection the proxy accepts is forwarded to one upstream address.
// Each direction of a connection has a reader, which decides a chunk's fate
// as it is read, and a writer, which delivers the chunks it was handed in
// order once they are due.
package faultproxy

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

const (
	chunkSize = 32 << 10
	// queueLen bounds the chunks delayed in one direction; past it the
	// reader stops reading, and TCP pushes back on the sender, as a slow
	// link would.
	queueLen = 256
	// replyGrace bounds how long a connection doomed by
	// ResetOnNextRequest(true) waits for the server's reply before it is
	// reset anyway.
	replyGrace  = 100 * time.Millisecond
	dialTimeout = 5 * time.Second
)

// Proxy forwards connections to one upstream server and injects faults into
// them. Its methods are safe for concurrent use.
type Proxy struct {
	upstream string
	ln       net.Listener
	ctx      context.Context // done when the proxy closes: ends dials under way
	stop     context.CancelFunc
	wg       sync.WaitGroup // every goroutine of the proxy

	mu          sync.Mutex
	conns       map[*conn]struct{}
	closed      bool
	partitioned bool
	partitions  uint64 // Partition calls so far: a chunk read before the latest one is lost
	latency     time.Duration
	armed       bool // ResetOnNextRequest waits for its chunk
	armForward  bool
}

// Start listens on 127.0.0.1:0 and forwards every accepted connection to
// upstream, until t ends: then it closes the listener, resets every
// connection and waits for all its goroutines, whatever fault is in force.
// Call it from the test's goroutine: it fails t if it cannot listen.
func Start(t testing.TB, upstream string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("faultproxy: %v", err)
	}
	ctx, stop := context.WithCancel(context.Background())
	p := &Proxy{upstream: upstream, ln: ln, ctx: ctx, stop: stop, conns: map[*conn]struct{}{}}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

// Addr is the address clients connect to instead of upstream's.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Partition makes the proxy a black hole: from now on every byte in either
// direction, on existing and new connections, is read and thrown away, and
// so are bytes read earlier but not yet delivered; nothing is closed and
// nothing answers, as with a network partition, a dead NAT entry or a hung
// load balancer. New connections are accepted and then stay silent too. A
// connection's end (FIN or RST) is swallowed as well.
func (p *Proxy) Partition() {
	p.mu.Lock()
	p.partitioned = true
	p.partitions++
	p.mu.Unlock()
}

// Heal ends a partition: every connection that lost bytes is reset (RST on
// both sides), since its streams are out of step; the others, and new
// connections, pass bytes again.
func (p *Proxy) Heal() {
	p.mu.Lock()
	p.partitioned = false
	var lost []*conn
	for c := range p.conns {
		if c.lost {
			lost = append(lost, c)
		}
	}
	p.mu.Unlock()
	for _, c := range lost {
		c.shut(true)
	}
}

// SetLatency delays every chunk by d in each direction, so that a round trip
// costs 2*d, keeping the order of each direction; 0 turns it off. It applies
// to bytes read from now on: bytes already delayed keep their due time, and
// a chunk never overtakes an earlier one.
func (p *Proxy) SetLatency(d time.Duration) {
	p.mu.Lock()
	p.latency = d
	p.mu.Unlock()
}

// ResetAll resets every open connection at once, with RST on both sides.
// Connections made afterwards pass as usual.
func (p *Proxy) ResetAll() {
	p.mu.Lock()
	all := make([]*conn, 0, len(p.conns))
	for c := range p.conns {
		all = append(all, c)
	}
	p.mu.Unlock()
	for _, c := range all {
		c.shut(true)
	}
}

// ResetOnNextRequest arms a one-shot fault for the next chunk that a client
// sends on any connection. With forward, that chunk is delivered to the
// server and the connection is reset (RST on both sides) as soon as the
// server answers, before any of the answer reaches the client, or 100ms
// after delivery if it does not answer: the server applied the request and
// the client never learns it. Without forward, the chunk is thrown away and
// the connection reset at once: the server never sees it. A partition in
// force when the chunk is read takes precedence, and the fault stays armed.
func (p *Proxy) ResetOnNextRequest(forward bool) {
	p.mu.Lock()
	p.armed, p.armForward = true, forward
	p.mu.Unlock()
}

// Conns reports the connections open now: accepted, connected upstream,
// and not yet closed by either end or by a fault.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

func (p *Proxy) close() {
	p.stop()
	_ = p.ln.Close()
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.ResetAll()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.wg.Go(func() { p.serve(c.(*net.TCPConn)) })
	}
}

func (p *Proxy) serve(client *net.TCPConn) {
	d := net.Dialer{Timeout: dialTimeout}
	up, err := d.DialContext(p.ctx, "tcp", p.upstream)
	if err != nil {
		_ = client.SetLinger(0)
		_ = client.Close()
		return
	}
	c := &conn{p: p, client: client, server: up.(*net.TCPConn), done: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.shut(true)
		return
	}
	p.conns[c] = struct{}{}
	p.mu.Unlock()
	toServer := &direction{q: make(chan chunk, queueLen), src: c.client, dst: c.server, request: true}
	toClient := &direction{q: make(chan chunk, queueLen), src: c.server, dst: c.client}
	p.wg.Go(func() { c.read(toServer) })
	p.wg.Go(func() { c.write(toServer) })
	p.wg.Go(func() { c.read(toClient) })
	c.write(toClient)
}

// conn is one proxied connection.
type conn struct {
	p              *Proxy
	client, server *net.TCPConn
	done           chan struct{} // closed when the connection is shut
	once           sync.Once

	// Guarded by p.mu.
	lost   bool // a partition threw some of its bytes away
	doomed bool // a forwarded request awaits its reply, which resets the connection
	ended  int  // directions whose source ended and whose end was passed on
}

// direction is one way through a connection.
type direction struct {
	q        chan chunk // closed by the reader when its source ends
	src, dst *net.TCPConn
	request  bool  // client to server
	err      error // why src ended, written before q is closed
}

type chunk struct {
	b          []byte
	due        time.Time
	partitions uint64 // Proxy.partitions when read
	doom       bool   // the request ResetOnNextRequest(true) picked
}

type verdict int

const (
	pass verdict = iota
	drop
	reset
)

func (c *conn) read(d *direction) {
	defer close(d.q)
	buf := make([]byte, chunkSize)
	for {
		n, err := d.src.Read(buf)
		if n > 0 {
			ch, v := c.p.route(c, d, buf[:n])
			switch v {
			case reset:
				c.shut(true)
				return
			case pass:
				select {
				case d.q <- ch:
				case <-c.done:
					return
				}
			}
		}
		if err != nil {
			d.err = err
			return
		}
	}
}

// route decides, as a chunk is read, what becomes of it.
func (p *Proxy) route(c *conn, d *direction, b []byte) (chunk, verdict) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.partitioned:
		c.lost = true
		return chunk{}, drop
	case !d.request && c.doomed:
		return chunk{}, reset
	}
	ch := chunk{b: bytes.Clone(b), due: time.Now().Add(p.latency), partitions: p.partitions}
	if d.request && p.armed {
		p.armed = false
		if !p.armForward {
			return chunk{}, reset
		}
		ch.doom = true
	}
	return ch, pass
}

func (c *conn) write(d *direction) {
	for ch := range d.q {
		if !c.sleepUntil(ch.due) {
			return
		}
		if !c.p.deliverable(c, ch) {
			continue
		}
		if _, err := d.dst.Write(ch.b); err != nil {
			c.shut(true)
			return
		}
		if ch.doom {
			select {
			case <-c.done:
			case <-time.After(replyGrace):
				c.shut(true)
			}
			return
		}
	}
	select {
	case <-c.done:
	default:
		c.p.end(c, d)
	}
}

// deliverable reports whether a chunk due now may be written: not when a
// partition began since it was read. A doomed chunk dooms its connection
// before it is written, so that no reply can slip through first.
func (p *Proxy) deliverable(c *conn, ch chunk) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.partitioned || ch.partitions != p.partitions {
		c.lost = true
		return false
	}
	c.doomed = c.doomed || ch.doom
	return true
}

// end passes on the end of d's source, once everything before it was
// delivered: a FIN as a FIN, anything else as a reset. During a partition
// it is lost, and the connection waits for Heal.
func (p *Proxy) end(c *conn, d *direction) {
	p.mu.Lock()
	if p.partitioned {
		c.lost = true
		p.mu.Unlock()
		return
	}
	c.ended++
	both := c.ended == 2
	p.mu.Unlock()
	if !errors.Is(d.err, io.EOF) {
		c.shut(true)
		return
	}
	_ = d.dst.CloseWrite()
	if both {
		c.shut(false)
	}
}

func (c *conn) sleepUntil(due time.Time) bool {
	t := time.NewTimer(time.Until(due))
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-c.done:
		return false
	}
}

// shut closes both sides of c, with RST when rst is set, and forgets it.
func (c *conn) shut(rst bool) {
	c.once.Do(func() {
		close(c.done)
		for _, s := range [2]*net.TCPConn{c.client, c.server} {
			if rst {
				_ = s.SetLinger(0)
			}
			_ = s.Close()
		}
		c.p.mu.Lock()
		delete(c.p.conns, c)
		c.p.mu.Unlock()
	})
}
