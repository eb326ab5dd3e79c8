package main

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Every file of testdata/responses is in the corpus once, and only those;
// the shares sum to 100 %; every body is JSON, but the one without a
// Content-Type, which is empty.
func TestCorpus(t *testing.T) {
	files, err := fs.Glob(responseFiles, "testdata/responses/*")
	require.NoError(t, err)
	var listed []string
	total := 0
	for _, c := range corpus {
		listed = append(listed, "testdata/responses/"+c.file)
		assert.Positive(t, c.weight, c.file)
		total += c.weight
	}
	assert.ElementsMatch(t, files, listed)
	assert.Equal(t, 100, total, "shares in percent")
	assert.GreaterOrEqual(t, len(corpus), 6)

	resps, err := corpusResponses()
	require.NoError(t, err)
	require.Len(t, resps, len(corpus))
	for i, r := range resps {
		c := corpus[i]
		assert.Equal(t, c.status, r.Status, c.file)
		if c.contentType == "" {
			assert.Empty(t, r.Body, c.file)
			assert.Nil(t, r.Header, c.file)
			continue
		}
		assert.True(t, json.Valid(r.Body), c.file)
		assert.Equal(t, c.contentType, r.Header.Get("Content-Type"), c.file)
	}
}

func TestGzipSize(t *testing.T) {
	n, err := gzipSize(nil)
	require.NoError(t, err)
	assert.Zero(t, n, "an empty body is not compressed")
	body := bytes.Repeat([]byte(`{"id":"x"}`), 100)
	n, err = gzipSize(body)
	require.NoError(t, err)
	assert.Positive(t, n)
	assert.Less(t, n, len(body)/10, "a repeated body")
}

// The table prints each response and the shares' weighted means, a dash
// where a store, or gzip on an empty body, has no figure.
func TestWriteResponses(t *testing.T) {
	sizes := []responseSize{
		{Name: "a.json", Status: 201, Weight: 75, Body: 1000, Gzip: 400, Redis: 1200, RedisCompressed: 700, Postgres: 1100},
		{Name: "none", Status: 204, Weight: 25, Redis: 300, RedisCompressed: 300, Postgres: 900},
	}
	var b bytes.Buffer
	writeResponses(&b, sizes, 5000)
	assert.Regexp(t, `\n +response +status +share +body +gzip +Redis +Redis, CompressAbove 1024 +PostgreSQL *\n`+
		` +a\.json +201 +75 % +1000 +40 % +1200 +700 +1100 *\n`+
		` +none +204 +25 % +0 +- +300 +300 +900 *\n`+
		// (75×1200 + 25×300) / 100 = 975; (75×700 + 25×300) / 100 = 600.
		` +weighted mean +100 % +750 +40 % +975 +600 +1050 *\n`+
		`  CompressAbove 1024 takes 38 % off Redis's memory over this mix\n$`, b.String())

	for i := range sizes {
		sizes[i].Redis, sizes[i].RedisCompressed, sizes[i].Postgres = 0, 0, 0
	}
	b.Reset()
	writeResponses(&b, sizes, 5000)
	assert.Regexp(t, `\n +a\.json +201 +75 % +1000 +40 % +- +- +- *\n`, b.String())
	assert.Regexp(t, `\n +weighted mean +100 % +750 +40 % +- +- +- *\n$`, b.String(), "no saving without figures")

	b.Reset()
	writeResponses(&b, nil, 5000)
	assert.Empty(t, b.String())
}
