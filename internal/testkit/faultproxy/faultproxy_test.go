package faultproxy

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// silence is how long a connection must stay quiet to count as silent.
const silence = 300 * time.Millisecond

// echo is a server on loopback that sends back whatever it reads, and
// remembers it.
type echo struct {
	ln net.Listener
	mu sync.Mutex
	rx []byte
}

func startEcho(t *testing.T) *echo {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	e := &echo{ln: ln}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 1024)
				for {
					n, err := c.Read(buf)
					e.mu.Lock()
					e.rx = append(e.rx, buf[:n]...)
					e.mu.Unlock()
					if err != nil {
						return
					}
					if _, err := c.Write(buf[:n]); err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return e
}

// received is every byte the server has read so far, from any connection.
func (e *echo) received() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return string(e.rx)
}

func dial(t *testing.T, p *Proxy) net.Conn {
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip sends msg and reads as many bytes back, within wait.
func roundTrip(c net.Conn, msg string, wait time.Duration) (string, error) {
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	return readN(c, len(msg), wait)
}

func readN(c net.Conn, n int, wait time.Duration) (string, error) {
	_ = c.SetReadDeadline(time.Now().Add(wait))
	buf := make([]byte, n)
	n, err := io.ReadFull(c, buf)
	return string(buf[:n]), err
}

// requireReset checks that c was reset: a read fails at once with
// ECONNRESET, rather than timing out or seeing an orderly end.
func requireReset(t *testing.T, c net.Conn) {
	t.Helper()
	_, err := readN(c, 1, 2*time.Second)
	require.ErrorIs(t, err, syscall.ECONNRESET)
}

// eventually waits up to 2s for cond.
func eventually(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	require.Eventually(t, cond, 2*time.Second, 5*time.Millisecond, msg)
}

func TestForwards(t *testing.T) {
	e := startEcho(t)
	p := Start(t, e.ln.Addr().String())
	c := dial(t, p)
	got, err := roundTrip(c, "hello", time.Second)
	require.NoError(t, err)
	assert.Equal(t, "hello", got)
	assert.Equal(t, 1, p.Conns())

	// An orderly close travels through, and the proxy lets go of the
	// connection.
	require.NoError(t, c.Close())
	eventually(t, func() bool { return p.Conns() == 0 }, "the proxy still holds a connection the client closed")
}

func TestPartition(t *testing.T) {
	e := startEcho(t)
	p := Start(t, e.ln.Addr().String())
	before := dial(t, p)
	_, err := roundTrip(before, "a", time.Second)
	require.NoError(t, err)

	p.Partition()
	_, err = roundTrip(before, "b", silence)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "a partitioned connection answered or was closed")
	during := dial(t, p)
	_, err = roundTrip(during, "c", silence)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "a connection made during the partition answered or was closed")
	assert.Equal(t, "a", e.received(), "bytes sent during the partition reached the server")
	assert.Equal(t, 2, p.Conns(), "the partition closed a connection")

	p.Heal()
	requireReset(t, before)
	requireReset(t, during)
	got, err := roundTrip(dial(t, p), "d", time.Second)
	require.NoError(t, err, "a new connection after Heal")
	assert.Equal(t, "d", got)
	assert.Equal(t, "ad", e.received())
}

// Bytes delayed by latency when a partition begins are lost with it, and
// their connection is reset by Heal.
func TestPartitionLosesDelayedBytes(t *testing.T) {
	e := startEcho(t)
	p := Start(t, e.ln.Addr().String())
	p.SetLatency(200 * time.Millisecond)
	c := dial(t, p)
	_, err := c.Write([]byte("x"))
	require.NoError(t, err)
	time.Sleep(50 * time.Millisecond) // read by the proxy, not yet due
	p.Partition()
	p.SetLatency(0)
	_, err = readN(c, 1, silence)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	assert.Empty(t, e.received(), "a chunk read before the partition was delivered during it")
	p.Heal()
	requireReset(t, c)
}

func TestLatency(t *testing.T) {
	e := startEcho(t)
	p := Start(t, e.ln.Addr().String())
	c := dial(t, p)
	const d = 50 * time.Millisecond
	p.SetLatency(d)
	start := time.Now()
	got, err := roundTrip(c, "slow", time.Second)
	rtt := time.Since(start)
	require.NoError(t, err)
	assert.Equal(t, "slow", got)
	assert.GreaterOrEqual(t, rtt, 2*d, "a round trip took less than twice the latency")
	assert.Less(t, rtt, 2*d+200*time.Millisecond, "a round trip took far more than twice the latency")

	// Chunks sent apart keep their order, each delayed on its own rather
	// than one after the other.
	start = time.Now()
	for _, s := range []string{"1", "2", "3"} {
		_, err := c.Write([]byte(s))
		require.NoError(t, err)
		time.Sleep(10 * time.Millisecond)
	}
	got, err = readN(c, 3, time.Second)
	require.NoError(t, err)
	assert.Equal(t, "123", got)
	assert.Less(t, time.Since(start), 4*d, "delayed chunks queued behind each other's delay")

	p.SetLatency(0)
	start = time.Now()
	_, err = roundTrip(c, "fast", time.Second)
	require.NoError(t, err)
	assert.Less(t, time.Since(start), d, "SetLatency(0) left a delay")
}

func TestResetAll(t *testing.T) {
	e := startEcho(t)
	p := Start(t, e.ln.Addr().String())
	a, b := dial(t, p), dial(t, p)
	for _, c := range []net.Conn{a, b} {
		_, err := roundTrip(c, "x", time.Second)
		require.NoError(t, err)
	}
	p.ResetAll()
	requireReset(t, a)
	requireReset(t, b)
	assert.Equal(t, 0, p.Conns())
	_, err := roundTrip(dial(t, p), "y", time.Second)
	require.NoError(t, err, "a connection made after ResetAll")
}

func TestResetOnNextRequest(t *testing.T) {
	for _, forward := range []bool{true, false} {
		t.Run(map[bool]string{true: "Forward", false: "Drop"}[forward], func(t *testing.T) {
			e := startEcho(t)
			p := Start(t, e.ln.Addr().String())
			c := dial(t, p)
			_, err := roundTrip(c, "a", time.Second)
			require.NoError(t, err)

			p.ResetOnNextRequest(forward)
			_, err = c.Write([]byte("b"))
			require.NoError(t, err)
			requireReset(t, c)
			if forward {
				assert.Equal(t, "ab", e.received(), "the server did not get the request")
			} else {
				// Long enough for a forwarded byte to have arrived.
				time.Sleep(50 * time.Millisecond)
				assert.Equal(t, "a", e.received(), "the server got a dropped request")
			}

			// One shot: the next connection passes.
			got, err := roundTrip(dial(t, p), "c", time.Second)
			require.NoError(t, err)
			assert.Equal(t, "c", got)
		})
	}
}

// The proxy's cleanup ends even while a partition holds a connection whose
// client never closes it.
func TestCloseDuringPartition(t *testing.T) {
	e := startEcho(t)
	start := time.Now()
	t.Run("Partitioned", func(t *testing.T) {
		p := Start(t, e.ln.Addr().String())
		c, err := net.Dial("tcp", p.Addr())
		require.NoError(t, err)
		defer c.Close() // after the proxy's cleanup has run
		eventually(t, func() bool { return p.Conns() == 1 }, "the proxy did not take the connection")
		p.SetLatency(time.Hour)
		_, err = c.Write([]byte("never due"))
		require.NoError(t, err)
		p.Partition()
	})
	assert.Less(t, time.Since(start), 2*time.Second, "closing a partitioned proxy took too long")
}

// A reset from the server reaches the client as a reset.
func TestServerReset(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	p := Start(t, ln.Addr().String())
	c := dial(t, p)
	s, err := ln.Accept()
	require.NoError(t, err)
	require.NoError(t, s.(*net.TCPConn).SetLinger(0))
	require.NoError(t, s.Close())
	requireReset(t, c)
	eventually(t, func() bool { return p.Conns() == 0 }, "the proxy kept a connection the server reset")
}

// A client of a proxy whose upstream refuses connections is reset, not
// left hanging.
func TestUpstreamDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	p := Start(t, addr)
	// The reset may beat the end of the client's connect.
	c, err := net.Dial("tcp", p.Addr())
	if err == nil {
		defer c.Close()
		_, err = readN(c, 1, 2*time.Second)
	}
	require.ErrorIs(t, err, syscall.ECONNRESET)
	assert.Equal(t, 0, p.Conns())
}
