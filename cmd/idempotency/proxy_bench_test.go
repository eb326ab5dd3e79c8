package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// BenchmarkProxyNew sends new operations, one at a time and each on a new
// connection, through a proxy running in this process on Redis to a Go
// upstream: the proxy's own work, for a profile
// (go test -run - -bench ProxyNew -cpuprofile cpu.out ./cmd/idempotency).
func BenchmarkProxyNew(b *testing.B) {
	r := testserver.StartRedis(b)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"ch_1","amount":100}`)
	}))
	b.Cleanup(up.Close)
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"-redis", "redis://" + r.Addr, "proxy", "-upstream", up.URL,
			"-listen", "127.0.0.1:0", "-admin-listen", "", "-single-tenant"}, strings.NewReader(""), pw, io.Discard)
		pw.Close()
	}()
	b.Cleanup(func() { cancel(); <-done })
	line, _ := bufio.NewReader(pr).ReadString('\n')
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	m := servingLine.FindStringSubmatch(line)
	if m == nil {
		b.Fatalf("the proxy said %q", line)
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	i := 0
	for b.Loop() {
		i++
		req, _ := http.NewRequest(http.MethodPost, "http://"+m[1]+"/charges", strings.NewReader(`{"amount":100}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", fmt.Sprintf("bench-%d", i))
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			b.Fatalf("status %d", resp.StatusCode)
		}
	}
}
