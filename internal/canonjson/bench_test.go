package canonjson

import (
	"fmt"
	"strings"
	"testing"
)

// BenchmarkAppend measures a typical request body and the inputs that cost
// the most per byte: go test -run '^$' -bench Append -benchmem
func BenchmarkAppend(b *testing.B) {
	// A JSON request body of 1 KiB or a little more, as in the root
	// package's BenchmarkFingerprint.
	body := []byte(`{"currency":"eur","customer":"cus_9s6XKzkNRiz8i3","items":[`)
	for i := 0; len(body) < 1000; i++ {
		if i > 0 {
			body = append(body, ',')
		}
		body = fmt.Appendf(body, `{"sku":"sku_%06d","quantity": %d, "amount":%d.00}`, i*7919, i%5+1, i*137%10000)
	}
	body = append(body, "]}"...)

	// 1 MiB: objects nested as deep as allowed, each with its members out
	// of order, around a long string.
	const open, close = `{"z":1,"y":`, `,"x":2}`
	leaf := 1<<20 - MaxDepth*len(open+close)
	deep := []byte(strings.Repeat(open, MaxDepth) + `"` + strings.Repeat("x", leaf-2) + `"` + strings.Repeat(close, MaxDepth))

	// 1 MiB, one object with its members in reverse order.
	var wide []byte
	wide = append(wide, '{')
	for i := 0; len(wide) < 1<<20-20; i++ {
		if i > 0 {
			wide = append(wide, ',')
		}
		wide = fmt.Appendf(wide, `"%08d":0`, 99999999-i)
	}
	wide = append(wide, '}')

	for _, bc := range []struct {
		name string
		text []byte
	}{{"body", body}, {"deep", deep}, {"wide", wide}} {
		b.Run(bc.name, func(b *testing.B) {
			var out []byte
			b.SetBytes(int64(len(bc.text)))
			b.ReportAllocs()
			for b.Loop() {
				var err error
				if out, err = Append(out[:0], bc.text); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
