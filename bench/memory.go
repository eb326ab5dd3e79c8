package main

import (
	"bytes"
	"compress/gzip"
	"context"
	crand "crypto/rand"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
)

// recordMemory is what Redis holds for one completed record.
type recordMemory struct {
	Body          int // response body bytes
	Name          int // bytes of the record's key name (Key.Name; no Scope)
	CompressAbove int // the store's RedisOptions.CompressAbove
	Usage         int64
}

func (m recordMemory) Overhead() int64 { return m.Usage - int64(m.Body) }

// recordMemory completes one operation whose response is resp, under a key
// name of name bytes, and returns MEMORY USAGE of its record, which it then
// deletes. The store's prefix is as long as the default ("idem:"), and
// unique to the call, so that the key is as long as a default store's while
// a shared server's keys stay apart: Redis allocates in size classes, and
// the bench's own run prefix would have put the key one class up.
func (e *env) recordMemory(ctx context.Context, resp idempotency.Response, name, compressAbove int) (recordMemory, error) {
	var p [2]byte
	_, _ = crand.Read(p[:])
	prefix := fmt.Sprintf("%04x:", p)
	s, err := idempotency.NewRedisStore(e.redis, idempotency.RedisOptions{Prefix: prefix, CompressAbove: compressAbove})
	if err != nil {
		return recordMemory{}, err
	}
	defer s.Close()
	keyName := strings.Repeat("k", name)
	_, err = idempotency.New(s, idempotency.Options{}).Do(ctx, idempotency.Key{Name: keyName},
		fp, func(context.Context) (idempotency.Response, error) { return resp, nil })
	if err != nil {
		return recordMemory{}, err
	}
	key, err := findRecord(ctx, e.redis, prefix+"*:"+keyName)
	if err != nil {
		return recordMemory{}, err
	}
	// SAMPLES 0: every field, not an estimate from five.
	usage, err := e.redis.MemoryUsage(ctx, key, 0).Result()
	if err == nil {
		err = e.redis.Del(ctx, key).Err()
	}
	return recordMemory{Body: len(resp.Body), Name: name, CompressAbove: compressAbove, Usage: usage}, err
}

// jsonResponse is a 201 Created with body and a JSON Content-Type: the
// response every fixed-size sizing stores.
func jsonResponse(body []byte) idempotency.Response {
	return idempotency.Response{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: body}
}

// findRecord returns the one key that matches, on every master of a cluster.
func findRecord(ctx context.Context, c redis.UniversalClient, match string) (string, error) {
	var mu sync.Mutex
	var found []string
	scan := func(ctx context.Context, c *redis.Client) error {
		it := c.Scan(ctx, 0, match, 1000).Iterator()
		for it.Next(ctx) {
			mu.Lock()
			found = append(found, it.Val())
			mu.Unlock()
		}
		return it.Err()
	}
	var err error
	switch c := c.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, scan)
	case *redis.Client:
		err = scan(ctx, c)
	default:
		return "", fmt.Errorf("cannot scan a %T", c)
	}
	if err == nil && len(found) != 1 {
		err = fmt.Errorf("%d keys match %s, want 1", len(found), match)
	}
	if err != nil {
		return "", err
	}
	return found[0], nil
}

var (
	currencies = []string{"eur", "usd", "gbp", "chf", "sek"}
	statuses   = []string{"succeeded", "pending", "failed", "refunded"}
	words      = strings.Fields("invoice order subscription renewal monthly annual plan pro team seats " +
		"shipping express standard warehouse berlin paris london zurich stockholm customer account " +
		"payment transfer refund partial adjustment credit note tax vat reverse charge discount coupon")
)

// jsonBody returns a JSON document of exactly size bytes (at least 64)
// shaped like a payments API's list: random ids, amounts, currencies,
// timestamps and short descriptions, so that it compresses as such a
// response would. It is the same on every run.
func jsonBody(size int) []byte {
	rng := rand.New(rand.NewPCG(1, uint64(size)))
	pickOf := func(s []string) string { return s[rng.IntN(len(s))] }
	id := func() string {
		const alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
		b := make([]byte, 24)
		for i := range b {
			b[i] = alphabet[rng.IntN(len(alphabet))]
		}
		return string(b)
	}
	const head, tail = `{"object":"list","data":[`, `],"memo":"`
	b := []byte(head)
	for n := 0; ; n++ {
		item := fmt.Sprintf(`{"id":"txn_%s","amount":%d,"currency":"%s","status":"%s","created":%d,"description":"%s %s %d"}`,
			id(), rng.IntN(1000000), pickOf(currencies), pickOf(statuses), 1767225600+rng.IntN(10000000),
			pickOf(words), pickOf(words), rng.IntN(100000))
		if len(b)+1+len(item)+len(tail)+2 > size {
			break
		}
		if n > 0 {
			b = append(b, ',')
		}
		b = append(b, item...)
	}
	b = append(b, tail...)
	for len(b) < size-2 {
		b = append(b, pickOf(words)...)
		b = append(b, ' ')
	}
	return append(b[:size-2], `"}`...)
}

// compression is what gzip at one level does to a body.
type compression struct {
	Name       string
	Size       int           // compressed bytes
	Compress   time.Duration // per body, one core, writer reused
	Decompress time.Duration // per body, one core, reader reused
}

// gzipCost compresses and decompresses body repeatedly at the fastest and
// the default level.
func gzipCost(body []byte) ([]compression, error) {
	const reps = 300
	var out []compression
	for _, level := range []struct {
		name  string
		level int
	}{{"level 1 (fastest)", gzip.BestSpeed}, {"level 6 (default)", gzip.DefaultCompression}} {
		var buf bytes.Buffer
		zw, err := gzip.NewWriterLevel(&buf, level.level)
		if err != nil {
			return nil, err
		}
		start := time.Now()
		for range reps {
			buf.Reset()
			zw.Reset(&buf)
			if _, err := zw.Write(body); err != nil {
				return nil, err
			}
			if err := zw.Close(); err != nil {
				return nil, err
			}
		}
		c := compression{Name: level.name, Size: buf.Len(), Compress: time.Since(start) / reps}

		zipped := bytes.NewReader(buf.Bytes())
		zr, err := gzip.NewReader(zipped)
		if err != nil {
			return nil, err
		}
		start = time.Now()
		for range reps {
			zipped.Reset(buf.Bytes())
			if err := zr.Reset(zipped); err != nil {
				return nil, err
			}
			if _, err := io.Copy(io.Discard, zr); err != nil {
				return nil, err
			}
		}
		c.Decompress = time.Since(start) / reps
		out = append(out, c)
	}
	return out, nil
}

// writeCapacity prints what a store holds under the default 24 h retention,
// at a few rates of new operations, from the bytes per record measured for
// 200-byte and 10 KiB bodies under 36-byte key names.
func writeCapacity(w io.Writer, rep *report) {
	perRecord := func(ms []recordMemory, body int) int64 {
		for _, m := range ms {
			if m.Body == body && (m.Name == 36 || body != 200) && m.CompressAbove == 0 {
				return m.Usage
			}
		}
		return 0
	}
	const retention = 24 * 60 * 60 // seconds
	fmt.Fprintln(w, "\nCapacity under a 24 h retention (records held = new operations/s × 86,400; Redis used_memory, PostgreSQL disk):")
	for _, body := range []int{200, 10 << 10} {
		redisBytes, pgBytes := perRecord(rep.memory, body), perRecord(rep.pgBytes, body)
		if redisBytes == 0 && pgBytes == 0 {
			continue
		}
		for _, rate := range []int{10, 100, 1000} {
			records := int64(rate) * retention
			fmt.Fprintf(w, "  %5d-byte bodies, %4d/s: %11d records  Redis %s  PostgreSQL %s\n", body, rate, records,
				gib(records*redisBytes), gib(records*pgBytes))
		}
	}
}

func gib(bytes int64) string {
	if bytes == 0 {
		return "   n/a   "
	}
	return fmt.Sprintf("%6.1f GiB", float64(bytes)/(1<<30))
}
