package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// closedWithin reports whether conn is closed by its peer within d: a read
// returns EOF or an error other than a timeout.
func closedWithin(t *testing.T, conn net.Conn, d time.Duration) bool {
	t.Helper()
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(d)))
	_, err := io.Copy(io.Discard, conn)
	var ne net.Error
	return err == nil || !(errorAs(err, &ne) && ne.Timeout())
}

func errorAs(err error, target *net.Error) bool {
	ne, ok := err.(net.Error)
	if ok {
		*target = ne
	}
	return ok
}

// TestProxySlowClient: a client that sends its body a byte at a time is
// cut off at -read-timeout, and the upstream never hears of it; an idle
// keep-alive connection is closed at -idle-timeout.
func TestProxySlowClient(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p := startProxy(t, s.flags, u, "-read-timeout", "1s", "-idle-timeout", "1s")
	conn, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	require.NoError(t, err)
	defer conn.Close()
	_, err = fmt.Fprint(conn, "POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-1\r\n"+
		"X-Account-ID: acct_1\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n")
	require.NoError(t, err)
	start := time.Now()
	for i := 0; i < 40; i++ {
		if _, err := conn.Write([]byte(" ")); err != nil {
			break
		}
		time.Sleep(200 * time.Millisecond)
		if time.Since(start) > 3*time.Second {
			break
		}
	}
	assert.True(t, closedWithin(t, conn, 2*time.Second), "the slow client's connection is still open")
	assert.Less(t, time.Since(start), 6*time.Second)
	assert.Empty(t, u.stats(t).Operations["acct_1/slow-1"], "the upstream got the slow client's request")

	idle, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	require.NoError(t, err)
	defer idle.Close()
	_, err = fmt.Fprint(idle, "GET /anything HTTP/1.1\r\nHost: x\r\n\r\n")
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(idle), nil)
	require.NoError(t, err)
	resp.Body.Close()
	assert.True(t, closedWithin(t, idle, 3*time.Second), "the idle connection is still open")
}

// TestProxyReplayNotRead: a client that never reads its replay is cut off
// at -write-timeout instead of holding the answer.
func TestProxyReplayNotRead(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	const size = 24 << 20
	big := fmt.Sprint(size)
	first := startProxy(t, s.flags, u, "-max-response-bytes", big)
	p := startProxy(t, s.flags, u, "-max-response-bytes", big, "-write-timeout", "1s")
	require.Len(t, post(t, first.url, "/big?bytes="+big, "acct_1", "unread-1", `{}`).body, size)

	conn, err := net.Dial("tcp", strings.TrimPrefix(p.url, "http://"))
	require.NoError(t, err)
	defer conn.Close()
	_, err = fmt.Fprint(conn, "POST /big?bytes="+big+" HTTP/1.1\r\nHost: x\r\nIdempotency-Key: unread-1\r\n"+
		"X-Account-ID: acct_1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
	require.NoError(t, err)
	time.Sleep(3 * time.Second) // not reading, past the write timeout
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
	n, _ := io.Copy(io.Discard, conn)
	assert.Less(t, n, int64(size), "the whole replay reached a client that did not read it in time")
}

// TestProxyKeyHeader: -key-header names the field the API's clients send
// the key in; the upstream gets it under that name, and an Idempotency-Key
// from a client is not read.
func TestProxyKeyHeader(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p := startProxy(t, s.flags, u, "-key-header", "X-Idempotency-Key")
	first := decodeCharge(t, post(t, p.url, "/charges", "acct_1", "", `{}`, "X-Idempotency-Key", "xkey-1"))
	again := post(t, p.url, "/charges", "acct_1", "", `{}`, "X-Idempotency-Key", "xkey-1")
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	assert.Equal(t, first.ID, decodeCharge(t, again).ID)
	assert.Equal(t, "xkey-1", first.Seen["X-Idempotency-Key"])
	assert.Empty(t, first.Seen["Idempotency-Key"])
	_, calls := u.operation(t, "acct_1", "xkey-1")
	assert.Equal(t, 1, calls)
	assert.Equal(t, http.StatusBadRequest, post(t, p.url, "/charges", "acct_1", "other-1", `{}`).status,
		"a key in Idempotency-Key, which this API does not read")
}

// TestProxyKeepStatus: -keep-status stores and replays an upstream 500,
// and the proxy's own 504 at -operation-timeout, for an upstream that
// cannot be asked twice.
func TestProxyKeepStatus(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p := startProxy(t, s.flags, u, "-keep-status", "500,504")
	failed := post(t, p.url, "/flaky", "acct_1", "keep-1", `{}`)
	assert.Equal(t, http.StatusInternalServerError, failed.status)
	again := post(t, p.url, "/flaky", "acct_1", "keep-1", `{}`)
	assert.Equal(t, http.StatusInternalServerError, again.status)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	_, calls := u.operation(t, "acct_1", "keep-1")
	assert.Equal(t, 1, calls)

	hasty := startProxy(t, s.flags, u, "-keep-status", "504", "-operation-timeout", "400ms")
	assert.Equal(t, http.StatusGatewayTimeout, post(t, hasty.url, "/hang", "acct_1", "keep-2", `{}`).status)
	again = post(t, hasty.url, "/hang", "acct_1", "keep-2", `{}`)
	assert.Equal(t, http.StatusGatewayTimeout, again.status)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	_, calls = u.operation(t, "acct_1", "keep-2")
	assert.Equal(t, 1, calls, "the upstream that timed out is not asked again")

	code, _, stderr := command(t, "", "-redis", "redis://127.0.0.1:1", "proxy", "-single-tenant",
		"-upstream", "http://127.0.0.1:1", "-keep-status", "5000")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, `-keep-status: "5000" is no HTTP status`)
}

// get answers GET url: its status and body.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// TestProxyReadiness: /healthz answers while the process serves; /readyz
// only while the store and the upstream answer, and says which failed
// without the error's text.
func TestProxyReadiness(t *testing.T) {
	r, stopRedis, err := testserver.LaunchRedis()
	require.NoError(t, err)
	t.Cleanup(func() { _ = stopRedis() })
	flags := []string{"-redis", "redis://" + r.Addr}
	u := startUpstream(t)
	p := startProxy(t, flags, u)
	noUpstream := startProxy(t, flags, upstream{url: "http://127.0.0.1:1"})

	code, body := get(t, p.admin+"/readyz")
	assert.Equal(t, http.StatusOK, code, body)
	code, body = get(t, noUpstream.admin+"/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Equal(t, "upstream unreachable\n", body)

	require.NoError(t, stopRedis())
	code, body = get(t, p.admin+"/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Equal(t, "store unavailable\n", body)
	code, _ = get(t, p.admin+"/healthz")
	assert.Equal(t, http.StatusOK, code, "liveness does not hang on the store")
}

// TestProxyDrain: on SIGTERM, /readyz fails for -drain-delay while clients
// are still served, then the proxy stops; a second SIGTERM stops it at once.
func TestProxyDrain(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p := startProxyProcess(t, s.flags, u, "-admin-listen", "127.0.0.1:0", "-drain-delay", "1500ms")
	code, _ := get(t, "http://"+p.admin+"/readyz")
	require.Equal(t, http.StatusOK, code)
	start := time.Now()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	time.Sleep(300 * time.Millisecond)
	code, body := get(t, "http://"+p.admin+"/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Equal(t, "draining\n", body)
	decodeCharge(t, post(t, "http://"+p.addr, "/charges", "acct_1", "drain-1", `{}`))
	require.NoError(t, p.cmd.Wait())
	assert.GreaterOrEqual(t, time.Since(start), 1500*time.Millisecond, "stopped before the drain delay")

	q := startProxyProcess(t, s.flags, u, "-drain-delay", "1m")
	start = time.Now()
	require.NoError(t, q.cmd.Process.Signal(syscall.SIGTERM))
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, q.cmd.Process.Signal(syscall.SIGTERM))
	err := q.cmd.Wait()
	assert.Less(t, time.Since(start), 10*time.Second, "a second SIGTERM did not stop it at once")
	assert.Error(t, err, "exit status")
	assert.Contains(t, q.stderr.String(), "second signal")
}

// accessLine is one line of the access log.
type accessLine struct {
	Msg, Method, Path, Outcome string
	Status, Attempt            int
	DurationMS                 float64 `json:"duration_ms"`
	RequestID                  string  `json:"request_id"`
	KeyHashJSON                string  `json:"key_hash"`
}

// TestProxyAccessLog: -access-log writes one JSON line per request, with
// its outcome and a hash of its key, never the key; a request id is passed
// on to the upstream, or made.
func TestProxyAccessLog(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p := startProxy(t, s.flags, u, "-access-log")
	c := decodeCharge(t, post(t, p.url, "/charges", "acct_1", "secret-key-1", `{}`, "X-Request-Id", "req-abc"))
	assert.Equal(t, "req-abc", c.Seen["X-Request-Id"])
	post(t, p.url, "/charges", "acct_1", "secret-key-1", `{}`)
	post(t, p.url, "/charges", "acct_1", "secret-key-1", `{"other":1}`)
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Go(func() {
			time.Sleep(time.Duration(i) * 150 * time.Millisecond)
			post(t, p.url, "/slow?ms=600", "acct_1", "secret-key-2", `{}`)
		})
	}
	wg.Wait()
	code, _ := get(t, p.url+"/anything")
	assert.Equal(t, http.StatusOK, code)

	out := p.stdout()
	assert.NotContains(t, out, "secret-key")
	var lines []accessLine
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		var a accessLine
		require.NoError(t, json.Unmarshal([]byte(l), &a), "line %q", l)
		lines = append(lines, a)
	}
	require.Len(t, lines, 6)
	outcomes := []string{}
	for _, l := range lines {
		outcomes = append(outcomes, l.Outcome)
		assert.Equal(t, "request", l.Msg)
		assert.NotEmpty(t, l.RequestID)
	}
	assert.Equal(t, []string{"new", "replayed", "refused"}, outcomes[:3])
	assert.ElementsMatch(t, []string{"new", "waited"}, outcomes[3:5])
	assert.Equal(t, "unguarded", outcomes[5])
	assert.Equal(t, "req-abc", lines[0].RequestID)
	assert.Regexp(t, `^[0-9a-f]{32}$`, lines[1].RequestID)
	assert.Equal(t, http.StatusCreated, lines[0].Status)
	assert.Equal(t, http.StatusUnprocessableEntity, lines[2].Status)
	assert.Equal(t, 1, lines[0].Attempt)
	assert.Equal(t, "POST", lines[0].Method)
	assert.Equal(t, "/charges", lines[0].Path)
	assert.Regexp(t, `^[0-9a-f]{32}$`, lines[0].KeyHashJSON)
	assert.Equal(t, lines[0].KeyHashJSON, lines[1].KeyHashJSON)
	assert.NotEqual(t, lines[0].KeyHashJSON, lines[3].KeyHashJSON)
	assert.Empty(t, lines[5].KeyHashJSON)
}
