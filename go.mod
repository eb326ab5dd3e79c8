module github.com/idempotency-go/idempotency

go 1.26
