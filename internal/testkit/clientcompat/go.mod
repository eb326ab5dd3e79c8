module github.com/idempotency-go/idempotency/internal/testkit/clientcompat

go 1.26.0

require (
	github.com/hashicorp/go-retryablehttp v0.7.8
	github.com/idempotency-go/idempotency v0.0.0
	github.com/redis/go-redis/v9 v9.23.0
	github.com/stretchr/testify v1.12.1
	github.com/stripe/stripe-go/v82 v82.5.1
)

require (
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/hashicorp/go-cleanhttp v0.5.2 // indirect
	go.uber.org/atomic v1.12.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/sys v0.48.0 // indirect
)

replace github.com/idempotency-go/idempotency => ../../../
