package idempotency

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// Benchmarks of the hot paths: go test -run '^$' -bench . -benchmem
// The end-to-end figures come from go run ./bench.

// benchBody is a JSON request body of 1 KiB or a little more.
func benchBody() []byte {
	b := []byte(`{"currency":"eur","customer":"cus_9s6XKzkNRiz8i3","items":[`)
	for i := 0; len(b) < 1000; i++ {
		if i > 0 {
			b = append(b, ',')
		}
		b = fmt.Appendf(b, `{"sku":"sku_%06d","quantity": %d, "amount":%d.00}`, i*7919, i%5+1, i*137%10000)
	}
	return append(b, "]}"...)
}

func BenchmarkFingerprint(b *testing.B) {
	body := benchBody()
	b.Run("request", func(b *testing.B) {
		r := httptest.NewRequest(http.MethodPost, "/v1/charges", nil)
		r.Header.Set("Content-Type", "application/json")
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			requestFingerprint(r, body, nil)
		}
	})
	b.Run("FingerprintOf", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			FingerprintOf("charge", body)
		}
	})
}

// benchResponse is a typical stored response: a few header fields and a
// 1 KiB body.
func benchResponse() Response {
	return Response{
		Status: http.StatusCreated,
		Header: http.Header{
			"Content-Type": {"application/json"},
			"Location":     {"/v1/charges/ch_3MmlLrLkdIwHu7ix0snN0B15"},
			"X-Request-Id": {"req_0d8f0c1b7a3e4d2f"},
		},
		Body: benchBody(),
	}
}

// BenchmarkRedisClaim is Guard.Do replaying a completed record: one claim
// script, one round trip; in parallel, many goroutines whose claims share
// round trips (see batcher).
func BenchmarkRedisClaim(b *testing.B) {
	replay := func(b *testing.B, c redis.UniversalClient, parallel bool) {
		s, err := NewRedisStore(c, RedisOptions{})
		require.NoError(b, err)
		b.Cleanup(func() { s.Close() })
		g := New(s, Options{})
		k, fp := Key{Name: "replayed"}, FingerprintOf("charge", benchBody())
		fn := func(context.Context) (Response, error) { return benchResponse(), nil }
		do := func() bool {
			r, err := g.Do(context.Background(), k, fp, fn)
			if err != nil || !r.Replayed {
				b.Errorf("replay: %v, replayed %v", err, r.Replayed)
				return false
			}
			return true
		}
		_, err = g.Do(context.Background(), k, fp, fn)
		require.NoError(b, err)
		b.ReportAllocs()
		if parallel {
			b.SetParallelism(25)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() && do() {
				}
			})
			return
		}
		for b.Loop() && do() {
		}
	}
	b.Run("miniredis", func(b *testing.B) {
		c := redis.NewClient(&redis.Options{Addr: miniredis.RunT(b).Addr()})
		b.Cleanup(func() { c.Close() })
		replay(b, c, false)
	})
	b.Run("redis-server", func(b *testing.B) { replay(b, testserver.StartRedis(b).Client(), false) })
	b.Run("redis-server-parallel", func(b *testing.B) { replay(b, testserver.StartRedis(b).Client(), true) })
}

// BenchmarkRedisNewOperation is Guard.Do on a fresh key each time, on
// redis-server: the claim script, the operation, the complete script.
func BenchmarkRedisNewOperation(b *testing.B) {
	s, err := NewRedisStore(testserver.StartRedis(b).Client(), RedisOptions{})
	require.NoError(b, err)
	b.Cleanup(func() { s.Close() })
	g := New(s, Options{})
	fp := FingerprintOf("charge", benchBody())
	resp := benchResponse()
	fn := func(context.Context) (Response, error) { return resp, nil }
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		r, err := g.Do(context.Background(), Key{Name: "new-" + strconv.Itoa(i)}, fp, fn)
		if err != nil || r.Replayed {
			b.Fatalf("new operation: %v, replayed %v", err, r.Replayed)
		}
	}
}

// benchMiddleware is the middleware on the memory store around a handler
// that writes benchResponse, and a function serving one request under key.
func benchMiddleware() func(key string) *httptest.ResponseRecorder {
	resp := benchResponse()
	h := New(NewMemoryStore(MemoryOptions{}), Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for name, vs := range resp.Header {
			w.Header()[name] = vs
		}
		w.WriteHeader(resp.Status)
		_, _ = w.Write(resp.Body)
	}))
	body := benchBody()
	return func(key string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, "/v1/charges", bytes.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set(HeaderKey, key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		return rec
	}
}

// BenchmarkMiddlewareNewOperation is a request under a fresh key through the
// middleware on the memory store: the handler runs and its response is
// recorded, stored and sent.
func BenchmarkMiddlewareNewOperation(b *testing.B) {
	serve := benchMiddleware()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		if rec := serve("new-" + strconv.Itoa(i)); rec.Code != http.StatusCreated || rec.Header().Get(HeaderReplayed) != "" {
			b.Fatalf("new operation: status %d, %s %q", rec.Code, HeaderReplayed, rec.Header().Get(HeaderReplayed))
		}
	}
}

// BenchmarkMiddlewareReplay is a replayed request through the middleware on
// the memory store: the middleware's own cost.
func BenchmarkMiddlewareReplay(b *testing.B) {
	serve := benchMiddleware()
	require.Equal(b, http.StatusCreated, serve("replayed").Code)
	b.ReportAllocs()
	for b.Loop() {
		if rec := serve("replayed"); rec.Code != http.StatusCreated || rec.Header().Get(HeaderReplayed) != "true" {
			b.Fatalf("replay: status %d, %s %q", rec.Code, HeaderReplayed, rec.Header().Get(HeaderReplayed))
		}
	}
}
