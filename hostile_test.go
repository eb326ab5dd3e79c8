package idempotency_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/report"
)

// heapPeak samples the heap in use until stop is called, and returns its
// peak above the heap in use when it started.
func heapPeak() (stop func() uint64) {
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	base, peak := ms.HeapInuse, ms.HeapInuse
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		for {
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapInuse)
			select {
			case <-done:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	return func() uint64 {
		close(done)
		<-finished
		return peak - base
	}
}

// TestHostileRequests sends, to a real server running the middleware, the
// requests a hostile or broken client sends, each with its documented
// answer, and measures the heap while they run: no input makes the
// middleware hold more than its limits say.
func TestHostileRequests(t *testing.T) {
	const maxBody = 64 << 10
	var runs atomic.Int64
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	h := guard.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, MaxRequestBytes: maxBody, MaxResponseBytes: maxBody})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			if r.Header.Get("X-Write") == "100MiB" {
				chunk := make([]byte, 1<<20)
				for range 100 {
					if _, err := w.Write(chunk); err != nil {
						return
					}
				}
				return
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = io.Copy(io.Discard, r.Body)
		}))
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ReadTimeout = 300 * time.Millisecond // what bounds a client that trickles its body
	srv.Start()
	t.Cleanup(srv.Close)

	// raw sends head and body on a connection of its own and returns the
	// status of the answer, or 0 if the server closed the connection.
	raw := func(head string, body []byte, perByte time.Duration) int {
		c, err := net.Dial("tcp", srv.Listener.Addr().String())
		require.NoError(t, err)
		defer c.Close()
		_, err = io.WriteString(c, head)
		require.NoError(t, err)
		for i := 0; i < len(body); {
			n := len(body) - i
			if perByte > 0 {
				n = 1
				time.Sleep(perByte)
			}
			if _, err := c.Write(body[i : i+n]); err != nil {
				break // the server gave up on us
			}
			i += n
		}
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return 0
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode
	}
	post := func(key []string, contentType string, body string, header ...string) *http.Response {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(body))
		require.NoError(t, err)
		for _, k := range key {
			req.Header.Add(idempotency.HeaderKey, k)
		}
		if contentType != "" {
			req.Header.Set("Content-Type", contentType)
		}
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	deep := strings.Repeat("[", 10000) + strings.Repeat("]", 10000)
	stop := heapPeak()
	cases := 0
	for _, c := range []struct {
		name   string
		send   func() int
		status int
		ran    bool // the handler ran
	}{
		{"a key of 256 bytes", func() int { return post([]string{strings.Repeat("k", 256)}, "", "a").StatusCode }, 400, false},
		{"a key of 64 KiB", func() int { return post([]string{strings.Repeat("k", 64<<10)}, "", "a").StatusCode }, 400, false},
		{"control bytes in a bare key", func() int {
			return raw("POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a\x01b\r\nContent-Length: 1\r\n\r\n", []byte("a"), 0)
		}, 400, false},
		{"control bytes in an sf-string", func() int { return post([]string{"\"a\tb\""}, "", "a").StatusCode }, 400, false},
		{"an sf-string with parameters", func() int { return post([]string{`"k";a=1`}, "", "a").StatusCode }, 400, false},
		{"the key sent twice", func() int { return post([]string{"k1", "k1"}, "", "a").StatusCode }, 400, false},
		{"a body over the limit, chunked", func() int {
			return raw("POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k2\r\nTransfer-Encoding: chunked\r\n\r\n",
				[]byte(fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", maxBody+1, strings.Repeat("x", maxBody+1))), 0)
		}, 413, false},
		{"a Content-Length over the limit", func() int {
			return raw(fmt.Sprintf("POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k3\r\nContent-Length: %d\r\n\r\n", 1<<40), []byte("x"), 0)
		}, 413, false},
		{"a Content-Length longer than the body", func() int {
			return raw("POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k4\r\nContent-Length: 100\r\nConnection: close\r\n\r\n", []byte("short"), 0)
		}, 400, false}, // the body ends early when the read times out: unreadable, nothing claimed
		{"a body one byte every 100ms", func() int {
			return raw("POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k5\r\nContent-Length: 20\r\n\r\n", []byte(strings.Repeat("x", 20)), 100*time.Millisecond)
		}, 400, false},
		{"invalid UTF-8 as JSON", func() int { return post([]string{"k6"}, "application/json", "{\"a\":\"\xff\xfe\"}").StatusCode }, 201, true},
		{"JSON 10000 deep", func() int { return post([]string{"k7"}, "application/json", deep).StatusCode }, 201, true},
		{"a malformed form", func() int { return post([]string{"k8"}, "application/x-www-form-urlencoded", "a=%zz&%").StatusCode }, 201, true},
		{"a handler that writes 100 MiB", func() int { return post([]string{"k9"}, "", "a", "X-Write", "100MiB").StatusCode }, 200, true},
	} {
		cases++
		before := runs.Load()
		assert.Equal(t, c.status, c.send(), c.name)
		assert.Equal(t, c.ran, runs.Load() > before, "%s: the handler ran", c.name)
	}
	// Nothing refused was claimed: the keys of the refused bodies take a
	// good request at once, and the odd bodies that ran are replayed.
	for _, k := range []string{"k2", "k3", "k4", "k5"} {
		resp := post([]string{k}, "", "fine")
		assert.Equal(t, 201, resp.StatusCode, k)
		assert.Empty(t, resp.Header.Get(idempotency.HeaderReplayed), k)
	}
	assert.Equal(t, "true", post([]string{"k7"}, "application/json", deep).Header.Get(idempotency.HeaderReplayed))
	resp := post([]string{"k9"}, "", "a", "X-Write", "100MiB")
	assert.Equal(t, "too-large", resp.Header.Get(idempotency.HeaderBodyOmitted))
	peak := stop()
	t.Logf("heap in use above the start, at its peak: %.1f MiB", float64(peak)/(1<<20))
	report.Add(t, report.Entry{Suite: "hostile", Store: "memory", Operations: cases, PeakHeap: peak})
	// The 100 MiB went through 1 MiB at a time; the buffers are the limits'.
	assert.Less(t, peak, uint64(32<<20), "the heap grew with the input")
}

// TestManyWaitersOnOneKey: 100,000 duplicates of one running request. Past
// MaxWaiters (default 10,000) a duplicate gets ErrInFlight at once, so the
// waiters the Guard holds, and the heap they take, stay bounded; when the
// original completes, every waiter gets its answer.
func TestManyWaitersOnOneKey(t *testing.T) {
	if testing.Short() {
		t.Skip("100,000 calls")
	}
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{WaitTimeout: time.Minute})
	k, fp := idempotency.Key{Name: "hot"}, idempotency.FingerprintOf("charge", nil)
	started, finish := make(chan struct{}), make(chan struct{})
	go func() {
		_, _ = guard.Do(context.Background(), k, fp, func(context.Context) (idempotency.Response, error) {
			close(started)
			<-finish
			return idempotency.Response{Status: 201, Body: []byte("charged")}, nil
		})
	}()
	<-started
	stop := heapPeak()
	var replayed, refused, other atomic.Int64
	var wg sync.WaitGroup
	do := func() {
		res, err := guard.Do(context.Background(), k, fp, func(context.Context) (idempotency.Response, error) {
			return idempotency.Response{}, errors.New("a duplicate ran")
		})
		switch {
		case err == nil && res.Replayed && string(res.Response.Body) == "charged":
			replayed.Add(1)
		case errors.Is(err, idempotency.ErrInFlight):
			refused.Add(1)
		default:
			other.Add(1)
		}
	}
	// The first 10,000 wait; the other 90,000 arrive in waves, so that the
	// test itself holds no more goroutines than the Guard would.
	for range 10000 {
		wg.Go(do)
	}
	require.Eventually(t, func() bool { _, waiting := guard.InFlight(); return waiting == 10000 }, 30*time.Second, 10*time.Millisecond)
	for range 9 {
		var wave sync.WaitGroup
		for range 10000 {
			wave.Go(do)
		}
		wave.Wait()
	}
	assert.Equal(t, int64(90000), refused.Load(), "duplicates past MaxWaiters")
	close(finish)
	wg.Wait()
	peak := stop()
	report.Add(t, report.Entry{Suite: "hostile", Store: "memory", Operations: 100000, Duplicates: 99999,
		StrandedWaiters: 10000 - int(replayed.Load()), PeakHeap: peak})
	assert.Equal(t, int64(10000), replayed.Load(), "waiters that got the answer")
	assert.Zero(t, other.Load())
	t.Logf("heap in use above the start, at its peak, with 10,000 waiting: %.1f MiB (%.0f bytes a waiter)",
		float64(peak)/(1<<20), float64(peak)/10000)
	assert.Less(t, peak, uint64(200<<20))
}
