package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"embed"
	"fmt"
	"io"
	"net/http"
	"text/tabwriter"

	"github.com/idempotency-go/idempotency"
)

// responseFiles holds the bodies of the corpus: compact JSON, as
// encoding/json writes it, shaped like a payments API's answers, with
// made-up ids as random as real ones, so that they compress as real ones do.
//
//go:embed testdata/responses
var responseFiles embed.FS

// corpusEntry is one response of the corpus, and the share of the records a
// payments API's store holds that it stands for.
type corpusEntry struct {
	file        string // under testdata/responses
	status      int
	contentType string // "" for the empty body
	weight      int    // percent of the records; the corpus's weights sum to 100
}

// corpus is a payments API's mix of keyed requests, by the response each
// one stores. The weights are a judgement, not a measurement: put your own
// traffic's in to size your store.
var corpus = []corpusEntry{
	// Every checkout creates one: the request idempotency keys are made for.
	{"payment-intent.json", http.StatusCreated, "application/json", 40},
	// Issuers decline some card payments, and a 4xx is stored and replayed.
	{"card-declined.json", http.StatusPaymentRequired, "application/json", 7},
	// Invalid parameters are client bugs: rare once an integration is live.
	{"validation-problem.json", http.StatusUnprocessableEntity, "application/problem+json", 3},
	// A few payments in a hundred are refunded, some in parts.
	{"refund.json", http.StatusCreated, "application/json", 5},
	// Created at signup or a first checkout, then reused.
	{"customer.json", http.StatusCreated, "application/json", 10},
	// Internal services' commands (transfers, ledger entries) answer with the new id only.
	{"transfer-id.json", http.StatusCreated, "application/json", 17},
	// Cancellations, detached payment methods and webhook acknowledgements answer with no body.
	{"no-content", http.StatusNoContent, "", 15},
	// Batch endpoints are rare, but one record weighs as much as twenty payments.
	{"batch-payouts.json", http.StatusOK, "application/json", 3},
}

// corpusCompressAbove is the RedisOptions.CompressAbove the corpus is
// measured with beside the plain store.
const corpusCompressAbove = 1024

// corpusResponses returns the response of each entry of corpus, in order.
func corpusResponses() ([]idempotency.Response, error) {
	out := make([]idempotency.Response, len(corpus))
	for i, c := range corpus {
		body, err := responseFiles.ReadFile("testdata/responses/" + c.file)
		if err != nil {
			return nil, err
		}
		out[i] = idempotency.Response{Status: c.status, Body: body}
		if c.contentType != "" {
			out[i].Header = http.Header{"Content-Type": {c.contentType}}
		}
	}
	return out, nil
}

// responseSize is what one response of the corpus costs each store, under
// a 36-byte key name; a store's figure is 0 where it was not measured.
type responseSize struct {
	Name            string
	Status          int
	Weight          int   // percent of the records
	Body            int   // bytes
	Gzip            int   // bytes of the body gzipped at the fastest level; 0 for an empty body
	Redis           int64 // MEMORY USAGE
	RedisCompressed int64 // MEMORY USAGE with RedisOptions.CompressAbove corpusCompressAbove
	Postgres        int64 // pg_total_relation_size per record
}

// sizeResponses measures every response of the corpus: in Redis unless it
// is miniredis, in PostgreSQL over records records when it runs.
func (e *env) sizeResponses(ctx context.Context, records int) ([]responseSize, error) {
	resps, err := corpusResponses()
	if err != nil {
		return nil, err
	}
	out := make([]responseSize, len(resps))
	for i, resp := range resps {
		s := responseSize{Name: corpus[i].file, Status: resp.Status, Weight: corpus[i].weight, Body: len(resp.Body)}
		if s.Gzip, err = gzipSize(resp.Body); err != nil {
			return nil, err
		}
		if !e.embedded {
			plain, err := e.recordMemory(ctx, resp, 36, 0)
			if err != nil {
				return nil, fmt.Errorf("Redis memory of %s: %w", s.Name, err)
			}
			zipped, err := e.recordMemory(ctx, resp, 36, corpusCompressAbove)
			if err != nil {
				return nil, fmt.Errorf("Redis memory of %s, compressed: %w", s.Name, err)
			}
			s.Redis, s.RedisCompressed = plain.Usage, zipped.Usage
		}
		if e.pgNaive != nil {
			if s.Postgres, err = pgRecordBytes(ctx, e.pgNaive.pool, resp, records, e.concurrency); err != nil {
				return nil, fmt.Errorf("PostgreSQL bytes of %s: %w", s.Name, err)
			}
		}
		out[i] = s
	}
	return out, nil
}

// gzipSize returns the bytes of body gzipped at the fastest level, the
// level CompressAbove deflates at, or 0 for an empty body.
func gzipSize(body []byte) (int, error) {
	if len(body) == 0 {
		return 0, nil
	}
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	if err != nil {
		return 0, err
	}
	if _, err := zw.Write(body); err != nil {
		return 0, err
	}
	err = zw.Close()
	return buf.Len(), err
}

// writeResponses prints the corpus's table, ending with each column's mean
// weighted by the shares; a column not measured prints as dashes. The
// PostgreSQL figures averaged over records records.
func writeResponses(w io.Writer, sizes []responseSize, records int) {
	if len(sizes) == 0 {
		return
	}
	fmt.Fprintf(w, "\nBytes per completed record over a payments API's responses (bench/testdata/responses; 36-byte key names;"+
		" Redis MEMORY USAGE, PostgreSQL disk over %d records; gzip: the body at level 1, against its size):\n", records)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "  response\tstatus\tshare\tbody\tgzip\tRedis\tRedis, CompressAbove %d\tPostgreSQL\t\n", corpusCompressAbove)
	total := 0
	for _, s := range sizes {
		total += s.Weight
		fmt.Fprintf(tw, "  %s\t%d\t%d %%\t%d\t%s\t%s\t%s\t%s\t\n", s.Name, s.Status, s.Weight, s.Body,
			percentOf(float64(s.Gzip), float64(s.Body)), bytesOf(float64(s.Redis)), bytesOf(float64(s.RedisCompressed)),
			bytesOf(float64(s.Postgres)))
	}
	body := weighted(sizes, func(s responseSize) int64 { return int64(s.Body) })
	redis := weighted(sizes, func(s responseSize) int64 { return s.Redis })
	zipped := weighted(sizes, func(s responseSize) int64 { return s.RedisCompressed })
	fmt.Fprintf(tw, "  weighted mean\t\t%d %%\t%.0f\t%s\t%s\t%s\t%s\t\n", total, body,
		percentOf(weighted(sizes, func(s responseSize) int64 { return int64(s.Gzip) }), body),
		bytesOf(redis), bytesOf(zipped), bytesOf(weighted(sizes, func(s responseSize) int64 { return s.Postgres })))
	tw.Flush()
	if redis > 0 {
		fmt.Fprintf(w, "  CompressAbove %d takes %.0f %% off Redis's memory over this mix\n", corpusCompressAbove, 100*(1-zipped/redis))
	}
}

// weighted returns the mean of f over sizes, each counted Weight times.
func weighted(sizes []responseSize, f func(responseSize) int64) float64 {
	var sum, weights float64
	for _, s := range sizes {
		sum += float64(s.Weight) * float64(f(s))
		weights += float64(s.Weight)
	}
	return sum / weights
}

// bytesOf prints n bytes, or a dash for 0, a figure not measured.
func bytesOf(n float64) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", n)
}

// percentOf prints part as a percentage of whole, or a dash when whole is 0.
func percentOf(part, whole float64) string {
	if whole == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f %%", 100*part/whole)
}
