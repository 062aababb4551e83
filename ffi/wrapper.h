/* The DPDK headers phub binds (bindgen input). rte_config.h comes in through
 * pkg-config's `-include rte_config.h`. */
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_lcore.h>
#include <rte_launch.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>
#include <rte_ring.h>
#include <rte_eth_ring.h>
#include <rte_flow.h>
#include <rte_malloc.h>
#include "shim.h"
